"""t5tpu as installed, run from a directory outside the checkout: a wheel built from this checkout
in a fresh virtual environment, and the editable install (scripts/setup.sh's .venv). The gin
files, the task registrations and the vocabulary must all come from the installed package.

The fresh environment borrows the dependencies already installed in the running one (a .pth file
naming its site-packages), so nothing is downloaded; the wheel goes in with --no-deps."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest
from cli_runs import ROOT, TINY_EXPERIMENT, quick_training, read_jsonl, succeeded, t5tpu

# A wheel, a fresh environment, and plan/train/infer through the installed command line.
pytestmark = pytest.mark.slow

# What the build does not see: ignored by git, and version control. A stale build/ would put
# modules deleted since back into the wheel; *.egg-info and __pycache__ are left out anywhere.
NOT_SOURCE = {
    ".git", ".venv", "build", "dist", ".whl", ".gl", ".libtpu", ".pytest_cache", ".ruff_cache",
}  # fmt: skip
# Where each file comes from: python -c prints these for the interpreter it runs in.
WHERE_FROM = """
import json, t5tpu, t5tpu.configs, t5tpu.tasks
from t5tpu import package_files
print(json.dumps({"t5tpu": t5tpu.__file__, "t5tpu.configs": t5tpu.configs.__file__,
                  "t5tpu.tasks": t5tpu.tasks.__file__,
                  "experiments": package_files.configs_dir("experiments"),
                  "vocabulary": package_files.asset("cpu_vocab.model")}))
"""
QUESTION = "How do I learn Python?"


def _pip(*args, python=sys.executable):
    """pip of the running environment acting on `python`'s: offline, quiet about its version."""
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    cmd = [sys.executable, "-m", "pip", "--python", python, *args]
    return succeeded(subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300))


def _source_only(directory, names):
    top = os.path.samefile(directory, ROOT)
    return {
        name
        for name in names
        if name == "__pycache__" or name.endswith(".egg-info") or (top and name in NOT_SOURCE)
    }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel of a copy of the checkout (the build writes build/ and *.egg-info beside the
    sources; in the checkout it would race other builds and pick up stale files), and what the
    build printed."""
    source = tmp_path_factory.mktemp("source") / "t5tpu"
    shutil.copytree(ROOT, source, ignore=_source_only)
    out = tmp_path_factory.mktemp("wheel")
    build = _pip(
        "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--no-cache-dir",
        "-w", str(out), str(source),
    )  # fmt: skip
    (path,) = out.glob("t5tpu-*.whl")
    return path, build.stdout + build.stderr


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    """A fresh virtual environment with the wheel installed; the dependencies are the running
    environment's, named by a .pth line (a path, so the .pth files there, among them the
    editable install's, are not run)."""
    path = tmp_path_factory.mktemp("venv")
    python = str(path / "bin" / "python")
    create = [sys.executable, "-m", "venv", "--without-pip", str(path)]
    succeeded(subprocess.run(create, capture_output=True, text=True))
    _pip("install", "--no-deps", "--no-index", str(wheel[0]), python=python)
    ask = "import sysconfig; print(sysconfig.get_path('purelib'))"
    run = succeeded(subprocess.run([python, "-c", ask], capture_output=True, text=True))
    site_packages = run.stdout.strip()
    borrowed = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    pathlib.Path(site_packages, "borrowed_dependencies.pth").write_text(
        "".join(f"{directory}\n" for directory in sorted(borrowed))
    )
    return path, site_packages


def _elsewhere(tmp_path) -> pathlib.Path:
    """An empty working directory outside the checkout."""
    directory = tmp_path / "elsewhere"
    directory.mkdir()
    assert not directory.resolve().is_relative_to(pathlib.Path(ROOT).resolve())
    return directory


def _where_from(python, cwd, env=None) -> dict:
    run = subprocess.run(
        [python, "-c", WHERE_FROM], cwd=cwd, env=env, capture_output=True, text=True
    )
    return json.loads(succeeded(run).stdout)


def _plan_and_train(program, cwd, model_dir, env=None):
    """`t5tpu plan` and four training steps of the tiny experiment, named as a user would."""
    plan = succeeded(
        t5tpu("plan", f"--gin_file={TINY_EXPERIMENT}", program=program, cwd=cwd, env=env)
    )
    counts = [line for line in plan.stdout.splitlines() if line.startswith("model: ")]
    assert counts and counts[0].startswith("model: 1,050,368 parameters (float32)"), plan.stdout
    flags = [f"--gin_file={TINY_EXPERIMENT}", *quick_training(4), "--gin.EVAL_PERIOD=0"]
    train = t5tpu("train", *flags, model_dir=model_dir, program=program, cwd=cwd, env=env)
    succeeded(train)
    assert "step 4/4" in train.stdout
    assert (model_dir / "checkpoint_4").is_dir()
    return flags


def test_wheel_holds_every_config_the_tasks_and_the_assets(wheel):
    path, build_output = wheel
    names = set(zipfile.ZipFile(path).namelist())
    configs = pathlib.Path(ROOT, "configs")
    gin_files = {f"t5tpu/configs/{p.relative_to(configs)}" for p in configs.rglob("*.gin")}
    assert len(gin_files) > 40 and gin_files <= names, sorted(gin_files - names)
    assert {p for p in names if p.endswith(".gin")} == gin_files
    # Every module, subpackages included (a package missing from the list leaves it out).
    # (The checkout's own folder may be named t5tpu too: told apart by path, not by name.)
    package_dir = pathlib.Path(ROOT, "t5tpu")
    modules = {
        f"t5tpu/{path.relative_to(package)}"
        for package in (package_dir, pathlib.Path(ROOT))
        for path in package.glob("**/*.py" if package == package_dir else "tasks/*.py")
    }
    assert {"t5tpu/api/loading.py", "t5tpu/tasks/quora.py"} <= modules
    assert modules <= names, sorted(modules - names)
    for name in (
        "t5tpu/configs/__init__.py",
        "t5tpu/assets/cpu_vocab.model",
        "t5tpu/assets/quora_sample/train.tsv",
        "t5tpu/assets/quora_sample/validation.tsv",
    ):
        assert name in names, name
    # Nothing under a generic top-level name (configs/, tasks/), nor the tests.
    dist_info = "-".join(path.name.split("-")[:2]) + ".dist-info"  # t5tpu-VERSION.dist-info
    assert {name.split("/")[0] for name in names} == {"t5tpu", dist_info}
    # setuptools ships a data folder only as a listed package ([tool.setuptools] packages).
    assert "is absent from the `packages` configuration" not in build_output, build_output


def test_installed_wheel_plans_trains_and_infers_outside_the_checkout(venv, tmp_path):
    path, site_packages = venv
    cwd = _elsewhere(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = _where_from(str(path / "bin" / "python"), cwd, env)
    for name, file in where.items():
        assert file.startswith(site_packages + os.sep), (name, file)
    assert os.path.isfile(where["vocabulary"])

    program = [str(path / "bin" / "t5tpu")]
    model_dir = tmp_path / "model"
    flags = _plan_and_train(program, cwd, model_dir, env)
    run = t5tpu(
        "infer", *flags, f"--gin.INFER_INPUTS=[{json.dumps(QUESTION)}]",
        model_dir=model_dir, program=program, cwd=cwd, env=env,
    )  # fmt: skip
    succeeded(run)
    (row,) = read_jsonl(model_dir / "inference" / "inputs-4.jsonl")
    assert row["input"] == QUESTION and isinstance(row["prediction"], str)


def test_editable_install_plans_and_trains_from_another_directory(tmp_path):
    """The running environment's t5tpu (scripts/setup.sh installs it editable) reads the
    checkout's files wherever it is started."""
    cwd = _elsewhere(tmp_path)
    where = _where_from(sys.executable, cwd)
    assert where == {
        "t5tpu": os.path.join(ROOT, "t5tpu", "__init__.py"),
        "t5tpu.configs": os.path.join(ROOT, "configs", "__init__.py"),
        "t5tpu.tasks": os.path.join(ROOT, "tasks", "__init__.py"),
        "experiments": os.path.join(ROOT, "configs", "experiments"),
        "vocabulary": os.path.join(ROOT, "t5tpu", "assets", "cpu_vocab.model"),
    }
    program = [os.path.join(sysconfig.get_path("scripts"), "t5tpu")]
    _plan_and_train(program, cwd, tmp_path / "model")
