"""A roofline estimate of a compiled step on a TPU slice: XLA's cost analysis of the program
(FLOPs and bytes accessed per device) against the chip's bf16 peak and HBM bandwidth. An
estimate, not a measurement: the step takes at least the longer of the two times, and real steps
run slower (launch gaps, collectives, layouts XLA's count does not see)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation's chip: bf16 matmul peak and HBM bandwidth per chip, and how many jax
    devices a chip is (two TensorCores each a device on v2/v3; one megacore device on v4/v5p;
    one core on v5e/v6e)."""

    peak_flops: float
    hbm_bytes_per_s: float
    devices_per_chip: int = 1

    @property
    def device_flops(self) -> float:
        return self.peak_flops / self.devices_per_chip

    @property
    def device_bandwidth(self) -> float:
        return self.hbm_bytes_per_s / self.devices_per_chip


# Per chip, by libtpu's generation name (Topology.tpu_topology's prefix). Sources: Google Cloud
# TPU documentation, "TPU versions" / system architecture pages (v4, v5e, v5p, v6e: bf16 peak
# and HBM bandwidth per chip) and Jouppi et al., "A Domain-Specific Supercomputer for Training
# Deep Neural Networks", CACM 63(7), 2020, table 3 (v2: 46 TFLOP/s, 700 GB/s; v3: 123 TFLOP/s,
# 900 GB/s); Cloud's v2 page gives 45 TFLOP/s per chip (180 for a v2-8's four chips), used here.
CHIPS = {
    "v2": Chip(peak_flops=45e12, hbm_bytes_per_s=700e9, devices_per_chip=2),
    "v3": Chip(peak_flops=123e12, hbm_bytes_per_s=900e9, devices_per_chip=2),
    "v4": Chip(peak_flops=275e12, hbm_bytes_per_s=1200e9),
    "v5e": Chip(peak_flops=197e12, hbm_bytes_per_s=819e9),
    "v5p": Chip(peak_flops=459e12, hbm_bytes_per_s=2765e9),
    "v6e": Chip(peak_flops=918e12, hbm_bytes_per_s=1640e9),
}


def chip_of(tpu_topology: str | None) -> Chip | None:
    """The chip of a libtpu slice name ('v4:2x2x1' -> v4), None when not in CHIPS."""
    return CHIPS.get((tpu_topology or "").split(":")[0])


@dataclasses.dataclass(frozen=True)
class Roofline:
    """The floor of one step per device: compute (FLOPs at the peak) or memory (bytes at the
    bandwidth), whichever is longer, and the examples/s that floor allows."""

    flops: float  # per device, XLA's count
    bytes_accessed: float  # per device, XLA's count
    chip: Chip
    batch_size: int  # examples per step, all devices together
    scaled: float = 1.0  # how far XLA's counts were scaled up (see `of_train_step`)

    @property
    def compute_seconds(self) -> float:
        return self.flops / self.chip.device_flops

    @property
    def memory_seconds(self) -> float:
        return self.bytes_accessed / self.chip.device_bandwidth

    @property
    def step_seconds(self) -> float:
        return max(self.compute_seconds, self.memory_seconds)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_seconds >= self.memory_seconds else "memory"

    @property
    def examples_per_s(self) -> float:
        return self.batch_size / self.step_seconds


def of_train_step(
    *, flops: float, bytes_accessed: float, analytic_flops: float, loops: bool, chip, batch_size
) -> Roofline:
    """The roofline of a compiled train step from XLA's per-device counts. XLA's cost analysis
    counts a loop's body once (scanned layers, microbatches): with `loops`, both counts are
    scaled up to the analytic FLOPs (per device) when XLA's fall short of them."""
    scale = analytic_flops / flops if loops and 0 < flops < analytic_flops else 1.0
    return Roofline(flops * scale, bytes_accessed * scale, chip, batch_size, scale)


def describe(r: Roofline, generation: str) -> list[str]:
    """The plan's lines for a roofline."""
    scaled = (
        f" (XLA counts a loop's body once: scaled {r.scaled:.2f}x to the analytic FLOPs)"
        if r.scaled > 1.0
        else ""
    )
    return [
        f"  roofline (an ESTIMATE from XLA's cost analysis of the compiled step, not measured): "
        f"{r.flops / 1e12:.3f} TFLOP and {r.bytes_accessed / 1e9:.2f} GB per device a step"
        f"{scaled}",
        f"    at {generation}'s {r.chip.device_flops / 1e12:g} TFLOP/s bf16 peak and "
        f"{r.chip.device_bandwidth / 1e9:g} GB/s HBM per device: at least "
        f"{r.step_seconds * 1e3:.1f} ms a step ({r.bound}-bound), at most "
        f"{r.examples_per_s:,.0f} examples/s",
    ]
