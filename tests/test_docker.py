"""The container: the Dockerfile's promises checked statically everywhere, and built and run
(`docker run IMAGE train ...` on the tiny CPU experiment) where a docker daemon answers."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
from cli_runs import ROOT, TINY_EXPERIMENT

DOCKERFILE = os.path.join(ROOT, "Dockerfile")
IMAGE = "t5tpu-test:cpu"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction, continuation lines joined."""
    with open(DOCKERFILE) as f:
        text = re.sub(r"\\\n", " ", f.read())
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


def test_the_image_runs_t5tpu_as_a_user_and_installs_what_the_repository_has():
    instructions = _instructions()
    assert ("ENTRYPOINT", '["docker-entrypoint.sh"]') in instructions
    assert any(kind == "ARG" and args.startswith("JAX_EXTRA") for kind, args in instructions)
    users = [args for kind, args in instructions if kind == "USER"]
    assert users and users[-1] != "root"
    copied = [args.split()[:-1] for kind, args in instructions if kind == "COPY"]
    sources = [source for sources in copied for source in sources]
    assert {"pyproject.toml", "constraints.txt", "t5tpu", "configs", "tasks"} <= set(sources)
    missing = [s for s in sources if not os.path.exists(os.path.join(ROOT, s))]
    assert not missing, missing
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        kept = {line.strip()[1:].rstrip("/") for line in f if line.startswith("!")}
    assert set(sources) <= kept, set(sources) - kept  # nothing COPY'd is ignored


def _daemon_reason() -> str | None:
    """Why docker cannot build here, or None when it can."""
    if shutil.which("docker") is None:
        return "no docker command on this machine"
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "docker info did not answer in 10 s"
    if info.returncode != 0:
        return f"the docker command is here but no daemon answers: {info.stderr.strip()[:200]}"
    return None


@pytest.mark.slow
def test_docker_build_and_a_tiny_train_run_in_the_container(tmp_path):
    reason = _daemon_reason()
    if reason:
        pytest.skip(reason)
    build = subprocess.run(
        ["docker", "build", "-t", IMAGE, ROOT], capture_output=True, text=True, timeout=1800
    )
    assert build.returncode == 0, build.stderr[-3000:]
    os.chmod(tmp_path, 0o777)  # the image's user (uid 1000) writes MODEL_DIR here
    run = subprocess.run(
        ["docker", "run", "--rm", "-v", f"{tmp_path}:/work", IMAGE, "train"]
        + [f"--gin_file={TINY_EXPERIMENT}", "--gin.MODEL_DIR='/work/model'"]
        + ["--gin.TRAIN_STEPS=4", "--gin.BATCH_SIZE=8", "--gin.EVAL_PERIOD=0"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "done: step 4" in run.stdout
    assert os.path.isdir(tmp_path / "model" / "checkpoint_4")
