"""The model gin files behind a checkpoint (its config.gin or model.gin, or the files a user
names for it), read apart from the caller's gin config.

`t5tpu.load` and `t5tpu convert` read which model a checkpoint holds from these files while a
run's own config may be parsed (a server's experiment, a notebook's `t5tpu.finetune`): the
caller's config is set aside while they are read and put back after, so a library call never
wipes the process's settings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import gin

from t5tpu import package_files
from t5tpu.config import gin_setup

# Model files leave dropout to the run files; a model read for its parameters has none.
_MODEL_DEFAULTS = "DROPOUT_RATE = 0.0"
# A run's operative config.gin records the model's bindings in the scope of the MODEL macro
# that built them; model files bind them unscoped. Inside this scope both kinds apply.
_MODEL_SCOPE = "MODEL"


@contextlib.contextmanager
def _caller_config_set_aside() -> Iterator[None]:
    """gin's global config emptied, then restored as it was (bindings, macros, imports, search
    paths and what the operative config has recorded). gin has no public way to save it."""
    config = gin.config
    saved_bindings = {key: dict(values) for key, values in config._CONFIG.items()}  # noqa: SLF001
    saved_singletons = dict(config._SINGLETONS)  # noqa: SLF001
    saved_imports = set(config._IMPORTS)  # noqa: SLF001
    with config._OPERATIVE_CONFIG_LOCK:  # noqa: SLF001
        saved_operative = {key: dict(values) for key, values in config._OPERATIVE_CONFIG.items()}  # noqa: SLF001
    saved_paths = list(config._LOCATION_PREFIXES)  # noqa: SLF001
    locked = config.config_is_locked()
    gin.clear_config()
    try:
        yield
    finally:
        gin.clear_config()
        config._CONFIG.update(saved_bindings)  # noqa: SLF001
        config._SINGLETONS.update(saved_singletons)  # noqa: SLF001
        config._IMPORTS.update(saved_imports)  # noqa: SLF001
        with config._OPERATIVE_CONFIG_LOCK:  # noqa: SLF001
            config._OPERATIVE_CONFIG.update(saved_operative)  # noqa: SLF001
        config._LOCATION_PREFIXES[:] = saved_paths  # noqa: SLF001
        config._set_config_is_locked(locked)  # noqa: SLF001


@contextlib.contextmanager
def parsed(gin_files: list[str]) -> Iterator[None]:
    """A block in which `gin_files` are gin's config and nothing else, in the model's scope:
    what it builds (a T5Config, a vocabulary) is the checkpoint's model; the caller's config is
    back after it. gin files are found as on the command line; gin's own errors (OSError,
    ValueError, SyntaxError) pass through for the caller to name the checkpoint."""
    gin_setup.import_configurables()
    gin_setup.use_file_readers()
    with _caller_config_set_aside():
        for path in (".", package_files.config_search_path()):
            gin.add_config_file_search_path(path)
        gin.parse_config(_MODEL_DEFAULTS)
        gin.parse_config_files_and_bindings(gin_files, [], finalize_config=False)
        with gin.config_scope(_MODEL_SCOPE):
            yield


def is_bound(configurable: str, parameter: str) -> bool:
    """Whether `configurable.parameter` is bound, unscoped or in the model's scope; for use
    inside `parsed`'s block."""
    for key in (f"{configurable}.{parameter}", f"{_MODEL_SCOPE}/{configurable}.{parameter}"):
        try:
            gin.query_parameter(key)
            return True
        except ValueError:
            continue
    return False


def bound_model_config():
    """The config EncoderDecoderModel.config is bound to (unscoped or in the model's scope),
    built; None when the files bind none (T5Config's own bindings then make the model). For
    use inside `parsed`'s block: a T5Gemma checkpoint's files bind a T5GemmaConfig."""
    for key in ("EncoderDecoderModel.config", f"{_MODEL_SCOPE}/EncoderDecoderModel.config"):
        try:
            reference = gin.query_parameter(key)
        except ValueError:
            continue
        if isinstance(reference, gin.config.ConfigurableReference):
            return reference.scoped_configurable_fn()
        return reference
    return None
