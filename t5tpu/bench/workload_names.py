"""The names `t5tpu bench` gives its workloads and the implementations it measures, in a module
of their own: the command (light, imported before parsing) and the measuring modules (which
load jax) both use them, and the measuring modules must not import the command."""

WORKLOADS = ("train", "score", "greedy", "sampling", "beam", "pipeline")
HF = "hf_torch"
OURS = "t5tpu"
FLOAT32 = "t5tpu_float32"  # --compare_float32: the same model in float32
REFERENCES = (HF, FLOAT32)  # what t5tpu's figures are set against, when measured
