"""Shared test set-up: every test starts from an empty gin configuration.

Several tests parse gin files in-process (model configs, plans, conversions); without this, a
binding left by one (say the real T5 vocabulary on gs://) would leak into the next.
"""

import os

# transformers serves the tests as a PyTorch reference; with TensorFlow (and Keras 3) installed
# it would also load its TensorFlow classes, which refuse Keras 3 (pipeline() imports them).
os.environ.setdefault("USE_TF", "0")

import gin  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def tiny_config():
    """tiny.tiny_config: the tiny T5 1.1's geometry with a test's overrides."""
    from tiny import tiny_config as make

    return make


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


# scripts/test.sh hands whole files to two workers in collection order (--dist loadfile,
# --no-loadscope-reorder). Starting with the longest files (measured, minutes each) keeps both
# workers busy to the end, instead of one running test_resume.py alone after the other is done.
LONGEST_FIRST = (
    "test_resume.py",
    "test_cli.py",
    "test_plan.py",
    "test_squad_cli.py",
    "test_quora_cli.py",
    "test_multihost.py",
    "test_infer_inputs.py",
    "test_install.py",  # ~40 s: a wheel, a fresh environment, plan/train/infer twice
)


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the other files, and the tests in each, keep their order
