"""The container: the Dockerfile's promises checked statically everywhere; built and run by
scripts/container_check.sh (docker, else buildah, no daemon needed) when T5TPU_CONTAINER_TESTS=1."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from cli_runs import ROOT

DOCKERFILE = os.path.join(ROOT, "Dockerfile")


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


# The opt-in: building the image downloads hundreds of MB and takes minutes, so the default run
# leaves it out.
OPT_IN = "T5TPU_CONTAINER_TESTS"
CHECK = os.path.join(ROOT, "scripts", "container_check.sh")


@pytest.mark.slow
def test_the_image_builds_trains_predicts_and_serves_as_on_vertex_ai(capsys):
    """scripts/container_check.sh: the image built (docker, else buildah on a stand-in base where
    python:3.11-slim cannot be pulled), a tiny train -> eval -> infer in it as its user equal to
    the same runs outside it, the Vertex AI prediction container's health and predict (equal to
    t5tpu infer), and SIGTERM. Its numbers are printed."""
    if os.environ.get(OPT_IN) != "1":
        pytest.skip(f"set {OPT_IN}=1 to build and run the image (downloads hundreds of MB)")
    check = subprocess.run(["bash", CHECK], capture_output=True, text=True, timeout=3600)
    output = check.stdout + check.stderr
    assert check.returncode == 0, output[-4000:]
    for passed in (
        "ok: --help",
        "predictions equal those of the same runs outside it",
        "answered 200",
        "answered t5tpu infer's",
        "ok: SIGTERM: exit code 0",
        "all checks passed",
    ):
        assert passed in output, passed
    numbers = re.search(r"numbers: (.*)", output)
    assert numbers, output[-2000:]
    with capsys.disabled():
        print(f"\n{numbers.group(0)}")
