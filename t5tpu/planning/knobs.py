"""The changes to a run that lower its peak memory on the same slice (`t5tpu plan`'s list of
what to try when a run does not fit), each replanned with memory_plan."""

from __future__ import annotations

import dataclasses

from t5tpu import partitioning
from t5tpu.planning.memory_plan import MemoryPlan, plan_training


@dataclasses.dataclass(frozen=True)
class Knob:
    """One change to the run (as the gin binding that makes it) and the plan it leads to."""

    setting: str
    plan: MemoryPlan
    fits: bool  # its estimated peak is within the budget it was judged against


def _candidate_changes(plan: MemoryPlan, rules) -> list[tuple[str, dict]]:
    """(gin binding, replan arguments) for every change t5tpu can make on the same slice."""
    w, c, mesh = plan.workload, plan.config, plan.mesh
    devices = mesh["data"] * mesh["model"]
    changes = [
        (f"Partitioner.num_partitions = {parts}", {"num_partitions": parts})
        for parts in _divisors_above(devices, mesh["model"])
    ]
    if mesh["data"] > 1 and tuple(rules) == partitioning.standard_logical_axis_rules():
        changes.append(
            (
                "standard_logical_axis_rules.parameter_partitioning = '2d' (parameters, gradients "
                "and optimizer state sharded over 'data' too)",
                {"rules": partitioning.standard_logical_axis_rules("2d", "1d")},
            )
        )
    for micro in _divisors_above(w.batch_size // mesh["data"], w.num_microbatches):
        changes.append(
            (
                f"NUM_MICROBATCHES = {micro}",
                {"work": dataclasses.replace(w, num_microbatches=micro)},
            )
        )
    name = type(c).__name__  # the config's gin name: T5Config or T5GemmaConfig
    if c.remat_policy != "full":
        changes.append(
            (
                f"{name}.remat_policy = 'full'",
                {"config": dataclasses.replace(c, remat_policy="full")},
            )
        )
    if c.dtype != "bfloat16":
        changes.append(
            (f"{name}.dtype = 'bfloat16'", {"config": dataclasses.replace(c, dtype="bfloat16")})
        )
    return changes


def ranked(
    plan: MemoryPlan, optimizer, partitioner: partitioning.Partitioner, budget: int | None = None
) -> list[Knob]:
    """The changes that lower the peak on the same slice, lowest peak first: per kind of
    change the smallest one that fits (an estimated peak within `budget`, by default the
    chip's HBM), else the one that saves the most."""
    budget = plan.hbm if budget is None else budget
    devices = plan.mesh["data"] * plan.mesh["model"]
    best: dict[str, Knob] = {}
    for setting, change in _candidate_changes(plan, partitioner.rules):
        candidate = partitioning.Partitioner(
            change.get("num_partitions", partitioner.num_partitions),
            change.get("rules", partitioner.rules),
            plan.topology,
        )
        new = plan_training(
            change.get("config", plan.config),
            optimizer,
            candidate,
            change.get("work", plan.workload),
            devices,
        )
        if new.peak > 0.98 * plan.peak:
            continue  # saves (almost) nothing: the peak is elsewhere
        kind = setting.split("=")[0]
        known = best.get(kind)
        if known is None or (not known.fits and new.peak < known.plan.peak):
            best[kind] = Knob(setting, new, budget is not None and new.peak <= budget)
    return sorted(best.values(), key=lambda k: k.plan.peak)


def _divisors_above(n: int, current: int) -> list[int]:
    return [d for d in range(current + 1, n + 1) if n % d == 0]
