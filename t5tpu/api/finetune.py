"""`t5tpu.finetune`: `t5tpu train` from Python, for notebooks: the same gin files, macros and
runner, in this process, printing the same progress lines.

    model_dir = t5tpu.finetune(
        "configs/experiments/qp_is_duplicate_tiny_cpu.gin",
        model_dir="/tmp/demo", TRAIN_STEPS=200, BATCH_SIZE=16,
    )
    model = t5tpu.load(model_dir)
"""

from __future__ import annotations

from t5tpu.api.loading import library_notes_hidden
from t5tpu.runtime import lazy_imports
from t5tpu.storage import compilation_cache


def _binding(name: str, value) -> str:
    # repr() writes Python literals gin reads back (strings quoted, dicts, None, numbers); a
    # gin reference (e.g. '@adafactor()' or '%MACRO') is passed through as written.
    if isinstance(value, str) and value[:1] in "@%":
        return f"{name} = {value}"
    return f"{name} = {value!r}"


def finetune(
    *gin_files: str,
    model_dir: str,
    bindings: list[str] | tuple[str, ...] = (),
    search_paths: list[str] | tuple[str, ...] = (),
    method: str | None = None,
    **macros,
) -> str:
    """Trains as `t5tpu train --gin_file=... --gin.MODEL_DIR=... --gin.NAME=VALUE` would;
    returns MODEL_DIR. A rerun with the same arguments continues from its newest checkpoint.

    gin_files: experiment (and model, topology) gin files, found as on the command line.
    macros: macro values as Python values, e.g. TRAIN_STEPS=1000, LEARNING_RATE=1e-3,
      TASK_FEATURE_LENGTHS={"inputs": 128, "targets": 8}.
    bindings: any other gin binding as text, e.g. "train.relative_steps = True".
    method: 'full' or 'lora' (FINETUNE_METHOD; default: the gin files'): 'lora' trains low-rank
      adapters on the frozen INITIAL_CHECKPOINT_PATH, set with bindings such as "lora.rank = 16".
    Bad settings raise t5tpu.errors.UserError with the message the CLI would print.
    """
    # Training reads its data through TensorFlow: imported first, quietly, so that nothing
    # imported after it loads it with its start-up noise.
    lazy_imports.import_tensorflow_quietly()
    compilation_cache.enable()
    from t5tpu.config import gin_setup
    from t5tpu.runners import train

    all_bindings = [
        _binding("MODEL_DIR", str(model_dir)),
        *(_binding(name, value) for name, value in macros.items()),
        *([_binding("FINETUNE_METHOD", method)] if method is not None else []),
        *bindings,
    ]
    with library_notes_hidden():
        gin_setup.parse(
            gin_files=list(gin_files), bindings=all_bindings, search_paths=list(search_paths)
        )
        train.train()
    return str(model_dir)
