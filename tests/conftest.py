"""Shared test set-up: every test starts from an empty gin configuration; the fixtures
tiny_config and trained_tiny; JAX's compilation cache for the programs compiled in-process; the
files with slow tests run first.

Several tests parse gin files in-process (model configs, plans, conversions); without the empty
configuration, a binding left by one (say the real T5 vocabulary on gs://) would leak into the
next.
"""

import collections
import os
import tempfile

import gin
import pytest


@pytest.fixture
def tiny_config():
    """tiny.tiny_config: the tiny T5 1.1's geometry with a test's overrides."""
    from tiny import tiny_config as make

    return make


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory):
    """MODEL_DIR (a pathlib.Path) of the tiny Quora experiment trained for
    cli_runs.TRAINED_TINY_STEPS steps (cli_runs.train_tiny), once per test run (built_once.py:
    both workers share it): a checkpoint to evaluate, decode or load. The files that ask for it
    share it, so read it only: a test that writes into its MODEL_DIR (eval, or infer without
    INFER_OUTPUT_DIR) works on a copy (shutil.copytree). Tests of training itself train their
    own runs."""
    from built_once import built_once
    from cli_runs import TINY_EXPERIMENT, TRAINED_TINY_STEPS, file_digests, train_tiny

    def build(folder):
        train_tiny(folder / "model")
        return file_digests(folder / "model")

    folder, before = built_once(
        tmp_path_factory, "trained_tiny", build, TINY_EXPERIMENT, TRAINED_TINY_STEPS
    )
    path = folder / "model"
    yield path
    # Other files' tests would have seen what one wrote: say so at the end of the session.
    assert file_digests(path) == before, f"a test wrote into the shared {path}; copy it first"


# The generic text-to-text task's experiment: a tiny T5 copies the first word of a line.
TEXT_TO_TEXT_EXPERIMENT = "configs/experiments/text_to_text_tiny_cpu.gin"


@pytest.fixture(scope="session")
def trained_text_to_text(tmp_path_factory):
    """(MODEL_DIR, the training's stdout) of the text_to_text experiment trained as the gin file
    says (its 200 steps, evaluated at the last: eval_metrics.json and eval_examples/), once per
    test run (built_once.py), as `trained_tiny` is: read it only, copy it to write into it."""
    from built_once import built_once
    from cli_runs import file_digests, succeeded, t5tpu

    def build(folder):
        run = succeeded(t5tpu("train", f"--gin_file={TEXT_TO_TEXT_EXPERIMENT}", model_dir=folder))
        return {"stdout": run.stdout, "digests": file_digests(folder)}

    folder, built = built_once(
        tmp_path_factory, "trained_text_to_text", build, TEXT_TO_TEXT_EXPERIMENT
    )
    yield folder, built["stdout"]
    assert file_digests(folder) == built["digests"], (
        f"a test wrote into the shared {folder}; copy it first"
    )


@pytest.fixture(scope="session", autouse=True)
def temporary_folder(tmp_path_factory):
    """The temporary folder of this process and of the commands it starts, inside the run's base
    folder, so that it goes with it: what they leave there (TensorFlow's autograph sources, a
    killed command's scratch, libtpu's logs of `plan`'s compiles) would otherwise pile up in
    /tmp run after run."""
    folder = tmp_path_factory.mktemp("tmp", numbered=False)
    os.environ["TMPDIR"] = str(folder)
    os.environ["TPU_LOG_DIR"] = str(folder / "tpu_logs")  # libtpu's default is /tmp/tpu_logs
    tempfile.tempdir = None  # asked again at the next use
    return folder


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


def pytest_configure(config):
    """The programs the tests compile in this process (models built and run here) are kept in
    JAX's on-disk cache too, so the next run of the suite loads them instead of compiling. Its
    own directory beside the subprocesses': this process compiles while they run, and a program
    read while another process still writes it is a warning in their output. Turned on before
    the first compile, since JAX decides once whether a process uses a cache."""
    if config.getoption("numprocesses", None) and not _worker:
        return  # pytest-xdist's controller: it runs no tests
    from t5tpu.storage import compilation_cache

    subprocesses = compilation_cache.directory()
    if subprocesses is None:  # T5TPU_COMPILATION_CACHE=off
        return
    chosen = os.environ.get(compilation_cache.ENV)
    os.environ[compilation_cache.ENV] = f"{subprocesses}-pytest"
    try:
        compilation_cache.enable()
    finally:
        if chosen is None:
            del os.environ[compilation_cache.ENV]
        else:
            os.environ[compilation_cache.ENV] = chosen


# scripts/test.sh hands whole files to two workers in collection order (--dist loadfile,
# --no-loadscope-reorder). The files with tests marked `slow` (end-to-end runs of the command
# line, minutes per file) start first, the most slow tests first, so that both workers stay busy
# to the end, instead of one running a long file alone after the other is done; the quick files
# fill in behind them.
def pytest_collection_modifyitems(items):
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])  # stable: ties, and each file's tests, in order
