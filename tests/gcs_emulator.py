"""A local GCS emulator for gs:// tests: gcp-storage-emulator on 127.0.0.1, in memory.

TensorFlow's own gs:// filesystem always calls the real endpoint, so what these tests reach is
what goes through etils' epath (with EPATH_USE_TF=false: gcsfs) and tensorstore (orbax's
arrays): MODEL_DIR's checkpoints, configs, metrics, predictions and input positions. Data read
by tf.data (seqio sources) is not covered; ../shared/notes/gcs_emulator.md has the details.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

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
    }


@contextlib.contextmanager
def running_emulator(timeout_s: float = 30.0):
    """Starts the emulator, yields its endpoint URL, and stops it."""
    binary = shutil.which("gcp-storage-emulator") or os.path.join(
        os.path.dirname(sys.executable), "gcp-storage-emulator"
    )
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [binary, "start", "--host=127.0.0.1", f"--port={port}", "--in-memory"]
        + [f"--default-bucket={BUCKET}"],
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
    import json

    url = f"{endpoint}/storage/v1/b/{BUCKET}/o?prefix={prefix}"
    with urllib.request.urlopen(url, timeout=10) as response:
        return sorted(item["name"] for item in json.load(response).get("items", []))
