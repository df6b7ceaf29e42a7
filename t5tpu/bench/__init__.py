"""The benchmark behind `t5tpu bench`: workloads, the machine's limits they are measured
against, timing, and the report. The command's flags are t5tpu/cli/bench.py."""
