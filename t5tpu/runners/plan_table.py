"""docs/memory_plan.md's "Every experiment" table: `t5tpu plan`'s estimate for every TPU
experiment in configs/experiments/, rendered as Markdown. Nothing is compiled or allocated;
each row takes seconds on a CPU.

    python -m t5tpu.runners.plan_table docs/memory_plan.md   # rewrites the table in place
    python -m t5tpu.runners.plan_table                       # prints it
"""

from __future__ import annotations

import contextlib
import io
import os
import re

from t5tpu import package_files
from t5tpu.config import gin_setup
from t5tpu.partitioning import GiB
from t5tpu.runners import plan as plan_runner

TABLE_BEGIN = "<!-- experiment table: python -m t5tpu.runners.plan_table docs/memory_plan.md -->"
TABLE_END = "<!-- end of experiment table -->"
SIZES = ("small", "base", "large", "3B", "11B")
HEADER = (
    "| size | topology | task | mesh (data x model) | batch | inputs/targets | micro | remat "
    "| params | opt state | grads | activations | peak | HBM | fits | knob |"
)


def experiments() -> list[str]:
    """The TPU experiments (`*_v<chip>-<n>.gin`), as their paths under configs/."""
    names = os.listdir(package_files.configs_dir("experiments"))
    return sorted(
        f"configs/experiments/{name}" for name in names if re.search(r"_v\d[a-z]?-\d+\.gin$", name)
    )


def _name_parts(path: str) -> tuple[str, str, str]:
    """(size, topology, task) from `<task>_<size>[_lora]_<topology>.gin`."""
    stem = os.path.basename(path).removesuffix(".gin")
    sizes = "|".join(SIZES)
    task, size, lora, topology = re.fullmatch(rf"(.+)_({sizes})_(lora_)?(v.+)", stem).groups()
    return size, topology, f"{task} (LoRA)" if lora else task


def _knob(printed: str) -> str:
    """The first knob `t5tpu plan` printed that makes the step fit, or "larger slice" when it
    printed knobs and none fits; "" for a step that fits."""
    if "to make it fit" not in printed:
        return ""
    suggestions = printed.split("to make it fit", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    fitting = [line.strip().split(": peak ")[0] for line in suggestions if line.endswith("(fits)")]
    return fitting[0].split(" (")[0] if fitting else "larger slice"


def row(path: str) -> str:
    """One experiment's row: its gin files parsed as `t5tpu plan` parses them, then planned."""
    gin_setup.parse([path], [], [])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        plan = plan_runner.plan()
    size, topology, task = _name_parts(path)
    w, mesh = plan.workload, plan.mesh
    gib = [f"{n / GiB:.2f}" for n in (plan.params, plan.opt_state, plan.gradients)]
    cells = [
        size,
        topology,
        task,
        f"{mesh['data']}x{mesh['model']}",
        str(w.batch_size),
        f"{w.input_length}/{w.target_length}",
        str(w.num_microbatches),
        plan.config.remat_policy,
        *gib,
        f"{plan.activations / GiB:.2f}",
        f"**{plan.peak / GiB:.2f}**",
        f"{plan.hbm / GiB:g}",
        "yes" if plan.fits else "NO",
        _knob(printed.getvalue()),
    ]
    return "| " + " | ".join(cells) + " |"


def table() -> str:
    """The whole table, experiments ordered by model size, then topology and task."""
    paths = sorted(experiments(), key=lambda p: (SIZES.index(_name_parts(p)[0]), _name_parts(p)))
    lines = [HEADER, "|" + " --- |" * HEADER.count(" | ") + " --- |"]
    return "\n".join(lines + [row(p) for p in paths])


def with_table(document: str, rendered: str | None = None) -> str:
    """`document` with the text between TABLE_BEGIN and TABLE_END replaced by the table."""
    start = document.index(TABLE_BEGIN) + len(TABLE_BEGIN)
    end = document.index(TABLE_END, start)
    return f"{document[:start]}\n{rendered or table()}\n{document[end:]}"


if __name__ == "__main__":
    import pathlib
    import sys

    rendered = table()
    for target in map(pathlib.Path, sys.argv[1:]):
        target.write_text(with_table(target.read_text(encoding="utf-8"), rendered), "utf-8")
    if len(sys.argv) == 1:
        print(rendered)
