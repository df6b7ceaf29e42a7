"""scripts/accelerator_check.sh's wheel list (what a machine with jax but no network is handed)
names the versions this checkout pins, and both scripts parse. The check itself runs on an
accelerator; docs/PERFORMANCE.md says how it was tried on CPU."""

import pathlib
import re
import subprocess

from cli_runs import ROOT


def header_wheels() -> dict[str, str]:
    text = pathlib.Path(ROOT, "scripts", "accelerator_check.sh").read_text()
    return dict(re.findall(r"^#   ([A-Za-z0-9_.-]+)==([A-Za-z0-9_.-]+)$", text, re.MULTILINE))


def test_the_wheels_are_the_pinned_versions():
    pins = dict(
        line.strip().split("==")
        for line in pathlib.Path(ROOT, "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    wheels = header_wheels()
    assert "gin-config" in wheels
    assert all(pins[name] == version for name, version in wheels.items()), (wheels, pins)


def test_the_scripts_parse():
    for script in ("accelerator_check.sh", "accelerator_wheels.sh"):
        subprocess.run(["bash", "-n", f"{ROOT}/scripts/{script}"], check=True)
