"""t5tpu from Python: `load` a fine-tuned or downloaded T5 and call it, `finetune` with gin.

    import t5tpu
    model = t5tpu.load("/tmp/t5tpu_demo")          # a MODEL_DIR, HF directory or T5X checkpoint
    model.predict(["is duplicate: how do i learn python? <SEP> how to learn python?"])

    from t5tpu.tasks import quora                  # a task's own questions, asked as it trained
    quora.is_duplicate(model, "How do I learn Python?", "How can I learn Python?")

Everything here is also reachable as `t5tpu.load` / `t5tpu.finetune`; importing `t5tpu` alone
imports neither jax nor TensorFlow. Importing this package turns on jax's persistent compilation
cache as the command line does (t5tpu/runtime/compilation_cache.py).
"""

from t5tpu.runtime import compilation_cache

# Compiled programs kept on disk as the command line keeps them, so a notebook's second
# `load(...).predict` starts without compiling (T5TPU_COMPILATION_CACHE=off turns it off; a
# cache directory jax already has is left as it is).
compilation_cache.enable()

from t5tpu.api.finetune import finetune  # noqa: E402
from t5tpu.api.loading import load  # noqa: E402
from t5tpu.api.model import T5Model  # noqa: E402

__all__ = ["T5Model", "finetune", "load"]
