"""A local GCS emulator for gs:// tests: gcp-storage-emulator on 127.0.0.1, in memory.

TensorFlow's own gs:// filesystem always calls the real endpoint, so what these tests reach is
what goes through etils' epath (with EPATH_USE_TF=false: gcsfs) and tensorstore (orbax's
arrays): MODEL_DIR's checkpoints, configs, metrics, predictions and input positions. Data read
by tf.data (seqio sources) is not covered; ../shared/notes/gcs_emulator.md has the details.

The emulator is started through this file (`python gcs_emulator.py start ...`), which adds two
things of GCS's API that gcp-storage-emulator lacks: the object's generation in the headers of a
download (without it tensorstore cannot read an OCDBT manifest back, "Malformed
StorageGeneration", so orbax fails to save any item holding more than one array), and objects'
moveTo (gcsfs renames with it; answered 501, gcsfs retries for 30 s before copying instead).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from http import HTTPStatus

BUCKET = "t5tpu-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_environment(endpoint: str) -> dict[str, str]:
    """What a t5tpu process needs to talk to the emulator instead of Google."""
    return {
        "STORAGE_EMULATOR_HOST": endpoint,  # gcsfs
        "EPATH_USE_TF": "false",  # etils' epath through gcsfs, not TensorFlow's gs://
        "TENSORSTORE_GCS_HTTP_URL": endpoint,  # orbax's array files
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x",  # tensorstore: no credentials lookup
        # gcsfs: the plain client; its default asks Google's storage-control API per bucket
        # for the bucket's layout, and logs a credentials warning each time that fails.
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }


@contextlib.contextmanager
def running_emulator(timeout_s: float = 30.0):
    """Starts the emulator, yields its endpoint URL, and stops it."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "start", "--host=127.0.0.1", f"--port={port}"]
        + ["--in-memory", f"--default-bucket={BUCKET}", "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_until_up(endpoint, process, timeout_s)
        yield endpoint
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


def _wait_until_up(endpoint: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"gcp-storage-emulator exited with {process.returncode}")
        try:
            urllib.request.urlopen(f"{endpoint}/storage/v1/b/{BUCKET}", timeout=1).read()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"gcp-storage-emulator did not answer on {endpoint} in {timeout_s:g} s")


def object_names(endpoint: str, prefix: str = "") -> list[str]:
    """Names of the objects in the test bucket under `prefix`, for assertions."""
    url = f"{endpoint}/storage/v1/b/{BUCKET}/o?prefix={urllib.parse.quote(prefix)}"
    with urllib.request.urlopen(url, timeout=10) as response:
        return sorted(item["name"] for item in json.load(response).get("items", []))


def bucket_names(endpoint: str) -> list[str]:
    """The emulator's buckets: a run must never create one."""
    with urllib.request.urlopen(f"{endpoint}/storage/v1/b?project=test", timeout=10) as response:
        return sorted(item["name"] for item in json.load(response).get("items", []))


def read_object(endpoint: str, name: str) -> bytes:
    """The bytes of object `name` in the test bucket."""
    url = f"{endpoint}/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}?alt=media"
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def upload(endpoint: str, name: str, data: bytes) -> None:
    """Writes object `name` in the test bucket."""
    url = f"{endpoint}/upload/storage/v1/b/{BUCKET}/o?uploadType=media&name="
    request = urllib.request.Request(url + urllib.parse.quote(name, safe=""), data, method="POST")
    with urllib.request.urlopen(request, timeout=10):
        pass


def _serve(argv: list[str]) -> None:
    """Runs gcp-storage-emulator's command line with the additions the module docstring lists."""
    from gcp_storage_emulator import __main__ as emulator
    from gcp_storage_emulator.handlers import objects

    objects.download = _with_generation(objects.download)
    # Imported only now: its route table holds the download function it finds at import.
    from gcp_storage_emulator import server

    move = (
        r"^/storage/v1/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)"
        r"/moveTo/o/(?P<dest_object_id>.*[^/]+)$"
    )
    server.HANDLERS = ((move, {"POST": _move}), *server.HANDLERS)
    sys.exit(emulator.main(argv))


def _with_generation(download):
    """GCS's downloads name the object's generation in their headers; tensorstore reads it."""

    def download_with_generation(request, response, storage, *args, **kwargs):
        download(request, response, storage, *args, **kwargs)
        if response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
            params = request.params
            obj = storage.get_file_obj(params["bucket_name"], params["object_id"])
            response["x-goog-generation"] = obj["generation"]
            response["x-goog-metageneration"] = obj["metageneration"]

    return download_with_generation


def _move(request, response, storage, *args, **kwargs):
    """objects.move within a bucket: a copy, then the source deleted."""
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    bucket, source = request.params["bucket_name"], request.params["object_id"]
    try:
        moved = objects._copy(
            request.base_url, storage, bucket, source, bucket, request.params["dest_object_id"]
        )
    except NotFound:
        response.status = HTTPStatus.NOT_FOUND
        return
    storage.delete_file(bucket, source)
    response.json(moved)


if __name__ == "__main__":
    _serve(sys.argv[1:])
