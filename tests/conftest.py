"""Shared test set-up: every test starts from an empty gin configuration.

Several tests parse gin files in-process (model configs, plans, conversions); without this, a
binding left by one (say the real T5 vocabulary on gs://) would leak into the next.
"""

import os

import gin
import pytest


@pytest.fixture(autouse=True)
def empty_gin_config():
    gin.clear_config()
    yield
    gin.clear_config()


# Under pytest-xdist (scripts/test.sh runs two workers) each worker's t5tpu subprocesses keep
# their own compilation cache: JAX writes cache entries without a lock, so one worker could
# read a program the other is still writing.
if _worker := os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault(
        "T5TPU_COMPILATION_CACHE", os.path.expanduser(f"~/.cache/t5tpu/jax-{_worker}")
    )
