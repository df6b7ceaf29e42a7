"""t5tpu from Python: `load` a fine-tuned or downloaded T5 and call it, `finetune` with gin.

    import t5tpu
    model = t5tpu.load("/tmp/t5tpu_demo")          # a MODEL_DIR, HF directory or T5X checkpoint
    model.predict(["is duplicate: how do i learn python? <SEP> how to learn python?"])

    from t5tpu.tasks import quora                  # a task's own questions, asked as it trained
    quora.is_duplicate(model, "How do I learn Python?", "How can I learn Python?")

Everything here is also reachable as `t5tpu.load` / `t5tpu.finetune`; importing `t5tpu` alone
imports neither jax nor TensorFlow. `load` and `finetune` turn on jax's persistent compilation
cache as the command line does (t5tpu/storage/compilation_cache.py), so a notebook's second
`load(...).predict` starts without compiling; importing changes no setting.
"""

from t5tpu.api.finetune import finetune
from t5tpu.api.loading import load
from t5tpu.api.model import T5Model

__all__ = ["T5Model", "finetune", "load"]
