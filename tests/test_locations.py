"""storage/locations.py, the one place that says where a path points: remote (`scheme://`) or
local, file:// counted local, and a path made absolute the one way every module does it."""

from __future__ import annotations

import os
import pathlib

import pytest

from t5tpu.storage import locations


@pytest.mark.parametrize(
    "path, remote, absolute",
    [
        ("gs://bucket/run", True, True),
        ("s3://bucket/run", True, True),
        ("file:///tmp/run", False, True),
        ("/tmp/run", False, True),
        (pathlib.Path("/tmp/run"), False, True),
        ("run/checkpoint_3", False, False),
        ("", False, False),
        (None, False, False),
    ],
)
def test_where_a_path_points(path, remote, absolute):
    assert locations.is_remote(path) is remote
    assert locations.is_absolute(path) is absolute


def test_absolute_keeps_remote_paths_and_anchors_local_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert locations.absolute("gs://bucket/run/") == "gs://bucket/run/"
    assert locations.absolute("run/checkpoint_3") == os.path.join(tmp_path, "run/checkpoint_3")
    assert locations.absolute("/tmp/a/../run") == "/tmp/run"
    # file:// is local: the os functions, orbax and epath reach it as the plain path
    assert locations.absolute("file:///tmp/run") == "/tmp/run"
    assert locations.absolute(pathlib.Path("run")) == os.path.join(tmp_path, "run")


def test_the_bucket_of_a_remote_path():
    assert locations.bucket_of("gs://bucket/run/checkpoint_3") == "gs://bucket"
    assert locations.bucket_of("gs://bucket") == "gs://bucket"
