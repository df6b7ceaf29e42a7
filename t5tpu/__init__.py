"""t5tpu: fine-tune, evaluate and run T5 models on TPUs (and GPUs and CPUs) from gin files.

The command line is `t5tpu` (t5tpu/cli). From Python, `t5tpu.load(path)` returns a model to
call and `t5tpu.finetune(...)` trains one (t5tpu/api). They are imported on first use, so
`import t5tpu` (and `t5tpu --help`) stays free of jax and TensorFlow.
"""

_API = ("load", "finetune", "T5Model")


def __getattr__(name: str):
    if name in _API:
        from t5tpu import api

        return getattr(api, name)
    raise AttributeError(f"module 't5tpu' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
