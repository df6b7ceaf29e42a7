"""Where `t5tpu eval` and `t5tpu infer` write: EVAL_OUTPUT_DIR / INFER_OUTPUT_DIR, laid out as
MODEL_DIR is (storage.model_dir), or MODEL_DIR itself when they are None.

MODEL_DIR may be read-only (a colleague's run, a bucket mounted read-only), so the output folder
is checked before any work: a run that reads and compiles for minutes and then cannot write its
results has only wasted the time. The run's operative config is written with its first results,
never before (a failed run leaves the earlier run's config in place), under a temporary name
and renamed.
"""

from __future__ import annotations

import os

import jax
from etils import epath

from t5tpu.config import gin_setup
from t5tpu.errors import UserError
from t5tpu.storage import locations, remote
from t5tpu.storage import model_dir as paths

_PROBE = ".t5tpu-write-check"


def checked_output_dir(model_dir: str, output_dir: str | None, setting: str) -> str:
    """`output_dir`, else `model_dir`, once a file could be written there and removed again;
    `setting` is the macro that moves the output elsewhere (EVAL_OUTPUT_DIR, INFER_OUTPUT_DIR).
    Nothing is left behind: a folder that does not exist yet is checked through the nearest one
    that does (the run creates it with its first results)."""
    folder = output_dir or model_dir
    remote.check_storage(model_dir, "MODEL_DIR")
    remote.check_storage(output_dir, setting)
    probe_dir = epath.Path(folder)
    # A bucket has no folders to create: an object can go anywhere.
    if not locations.is_remote(folder):
        while not probe_dir.exists() and probe_dir.parent != probe_dir:
            probe_dir = probe_dir.parent
    # A name of this process's own: the processes of a multi-host run check one folder at once.
    probe = probe_dir / f"{_PROBE}-{jax.process_index()}-{os.getpid()}"
    try:
        probe.write_text("")
        probe.unlink(missing_ok=True)
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise UserError(
            f"cannot write to {folder} ({why}); set {setting} to a folder you can write, e.g. "
            f"--gin.{setting}=\"'/tmp/results'\" (MODEL_DIR is only read then)"
        ) from None
    return folder


# The setting that moves each run's config (and results) elsewhere, named when the folder
# cannot be written.
_CONFIG_SETTINGS = {paths.EVAL_CONFIG: "EVAL_OUTPUT_DIR", paths.INFER_CONFIG: "INFER_OUTPUT_DIR"}


def write_config(path: str) -> None:
    """The operative gin config to `path` (process 0 only), atomically: a reader sees the old
    config or the new one, never half of one."""
    setting = _CONFIG_SETTINGS.get(os.path.basename(path), "MODEL_DIR")
    gin_setup.write_operative_config(path, setting=setting)
