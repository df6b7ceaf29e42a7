"""The layout of MODEL_DIR: the one place that names every file and folder a run writes there.

    MODEL_DIR/
      checkpoint_<step>/             orbax checkpoint: params/, opt_state/, input_position/
      checkpoint_<step>.incomplete/  a damaged checkpoint moved aside when its step is saved again
      config.gin                     operative config of the training run
      train.lock                     held by the one `t5tpu train` writing here (writer_lock.py)
      config_to_step_<step>.gin      an earlier training config, kept when a resume changed it
      eval_config.gin, infer_config.gin
      model.gin                      the model's geometry (written by `t5tpu convert`)
      train/, eval/, eval_<split>/   TensorBoard events
      eval_metrics.json, eval_<split>_metrics.json
      eval_examples/<task>-<step>.jsonl, eval_<split>_examples/<task>-<step>.jsonl
                                     each example evaluated: input, target, prediction
      inference/<source>-<step>.jsonl  (runners/prediction_files.py adds the decoding settings)

Runners, the checkpoint code and the tools build paths with these functions rather than
spelling the names, so the layout can be read (and changed) here.
"""

from __future__ import annotations

import os
import re

STEP_PREFIX = "checkpoint"  # checkpoint_<step>, as T5X names them
INCOMPLETE_SUFFIX = ".incomplete"
TRAIN_CONFIG = "config.gin"
EVAL_CONFIG = "eval_config.gin"
INFER_CONFIG = "infer_config.gin"
MODEL_GIN = "model.gin"
TRAIN_SUMMARIES = "train"
INFERENCE = "inference"
INPUT_POSITION = "input_position"
TRAIN_LOCK = "train.lock"

_STEP_DIR = re.compile(rf"{STEP_PREFIX}_(\d+)")


def checkpoint_name(step: int) -> str:
    return f"{STEP_PREFIX}_{step}"


def checkpoint_dir(model_dir: str, step: int) -> str:
    return os.path.join(model_dir, checkpoint_name(step))


def incomplete_checkpoint_name(step: int) -> str:
    """Where a damaged checkpoint_<step> is moved aside: orbax never lists it, and it stays for
    a look."""
    return f"{checkpoint_name(step)}{INCOMPLETE_SUFFIX}"


def step_of(path: str) -> int | None:
    """The step of a checkpoint_<step> directory path (a trailing slash allowed), else None."""
    match = _STEP_DIR.fullmatch(os.path.basename(path.rstrip("/")))
    return int(match.group(1)) if match else None


def input_position(checkpoint: str, process_index: int) -> str:
    """Where one training process keeps its input stream's position inside a checkpoint, so the
    position goes when orbax deletes that checkpoint."""
    return os.path.join(checkpoint, INPUT_POSITION, f"process_{process_index}")


def kept_train_config(first_step: int) -> str:
    """The name an earlier training config is kept under when a resume at `first_step` changes
    the settings."""
    return f"config_to_step_{first_step}.gin"


def kept_train_config_path(model_dir: str, first_step: int) -> str:
    return os.path.join(model_dir, kept_train_config(first_step))


def train_lock(model_dir: str) -> str:
    """The lock file that keeps a second `t5tpu train` off a MODEL_DIR being trained."""
    return os.path.join(model_dir, TRAIN_LOCK)


def train_config(model_dir: str) -> str:
    return os.path.join(model_dir, TRAIN_CONFIG)


def eval_config(model_dir: str) -> str:
    return os.path.join(model_dir, EVAL_CONFIG)


def infer_config(model_dir: str) -> str:
    return os.path.join(model_dir, INFER_CONFIG)


def eval_run(split: str) -> str:
    """'eval' for the validation split, else 'eval_<split>': names its TensorBoard directory,
    metrics file and examples folder, so a quick look at another split never replaces
    validation results."""
    return "eval" if split == "validation" else f"eval_{split}"


def eval_summaries(model_dir: str, split: str) -> str:
    return os.path.join(model_dir, eval_run(split))


def eval_metrics(model_dir: str, split: str) -> str:
    return os.path.join(model_dir, f"{eval_run(split)}_metrics.json")


def eval_examples_dir(model_dir: str, split: str) -> str:
    return os.path.join(model_dir, f"{eval_run(split)}_examples")


def eval_examples(model_dir: str, split: str, task: str, step: int) -> str:
    """One task's examples as evaluated at `step`, beside the metrics they were counted in."""
    return os.path.join(eval_examples_dir(model_dir, split), f"{task}-{step}.jsonl")


def train_summaries(model_dir: str) -> str:
    return os.path.join(model_dir, TRAIN_SUMMARIES)


def inference_dir(model_dir: str) -> str:
    return os.path.join(model_dir, INFERENCE)
