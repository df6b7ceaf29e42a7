"""`t5tpu.load`: a T5Model from a t5tpu MODEL_DIR (or one of its checkpoint_N), a Hugging Face
T5 directory, or a T5X / Mesh TF checkpoint, with its parameters placed on the devices jax has.

What the model is comes from the checkpoint's own description: the model.gin or config.gin
beside a t5tpu checkpoint, config.json and spiece.model in a Hugging Face directory. A T5X or
Mesh TF checkpoint describes neither its vocabulary nor its activations, so pass the model gin
file it was trained with (`gin_files=["configs/models/t5_1_1/base.gin"]`).

How it answers comes from the run that trained it (its run record, storage/run_record.py): the
lengths, the task's shaping of a raw input, the decoding defaults; a Hugging Face export carries
the same in its config files. What a caller passes instead is used instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging as std_logging

from absl import logging

from t5tpu.api.model import Shapes, T5Model
from t5tpu.data import vocab
from t5tpu.formats import loader
from t5tpu.model import param_shapes
from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.partitioning import Partitioner
from t5tpu.runners.run_lengths import DEFAULT_LENGTHS
from t5tpu.runtime import lazy_imports
from t5tpu.storage import compilation_cache


def load(
    path: str,
    *,
    step: int | None = None,
    gin_files: list[str] | tuple[str, ...] = (),
    batch_size: int = 8,
    max_input_length: int | None = None,
    max_target_length: int | None = None,
    dtype: str | None = None,
    partitioner: Partitioner | None = None,
) -> T5Model:
    """The model at `path`, ready to call (see T5Model).

    path: a t5tpu MODEL_DIR (its newest readable checkpoint, or `step`), a checkpoint_<step>
      directory, a Hugging Face T5 directory (config.json + weights, spiece.model for text),
      or a T5X / Mesh TF checkpoint (with `gin_files`). gs:// paths work as on the CLI.
    batch_size: rows per compiled call; fewer inputs are padded to it, more run in turns.
    max_input_length / max_target_length: inputs are truncated to the first (keeping EOS),
      decoding stops at the second unless a call says otherwise; default: the lengths the run
      trained with (TASK_FEATURE_LENGTHS, from its run record), else 512 and 128.
    dtype: 'bfloat16' or 'float32': the activations' dtype and the one parameters are cast
      to, once, for every call (bf16 inputs with float32 accumulation in every matmul); default:
      the checkpoint's own (its gin's T5Config.dtype; float32 for an imported checkpoint).
    partitioner: how parameters and batches are laid out; default: every device jax has,
      data-parallel (parameters replicated), as `t5tpu infer` does on one host.
    """
    # As the CLI does at its start, not on import: programs cached on disk, and TensorFlow's
    # first import (etils' gs:// client, seqio) quiet.
    compilation_cache.enable()
    lazy_imports.quiet_tensorflow_imports()
    partitioner = partitioner or Partitioner()
    with library_notes_hidden():
        checkpoint = loader.open_checkpoint(str(path), step=step, setting="path")
        model, has_vocabulary = _network(checkpoint, gin_files, dtype)
        abstract, shardings = param_shapes.sharded_abstract_params(model.config, partitioner)
        params = checkpoint.load(abstract, shardings)
        record = checkpoint.run_record()
    recorded = (record.input_length, record.target_length) if record else DEFAULT_LENGTHS
    shapes = Shapes.for_devices(
        batch_size=batch_size,
        max_input_length=recorded[0] if max_input_length is None else max_input_length,
        max_target_length=recorded[1] if max_target_length is None else max_target_length,
        data_parallelism=partitioner.data_parallelism,
    )
    return T5Model(
        model=model,
        params=params,
        param_shardings=shardings,
        partitioner=partitioner,
        shapes=shapes,
        has_vocabulary=has_vocabulary,
        source=checkpoint.path,
        record=record,
    )


def _network(
    checkpoint: loader.Checkpoint, gin_files, dtype: str | None
) -> tuple[EncoderDecoderModel, bool]:
    """The model the checkpoint (or `gin_files`) describes, in `dtype` if given, and whether
    its vocabulary is known."""
    described = checkpoint.model(gin_files)
    vocabulary = described.vocabulary
    if vocabulary is None and described.gin_files and checkpoint.step_dir:
        # A run that bound no vocabulary trained with the bundled one, which
        # default_vocabulary returns unbound.
        vocabulary = vocab.default_vocabulary()
    config = described.config
    if dtype is not None:
        config = dataclasses.replace(config, dtype=dtype)
    return EncoderDecoderModel(config, vocabulary or _NoVocabulary()), vocabulary is not None


@contextlib.contextmanager
def library_notes_hidden():
    """orbax logs routine notes as absl warnings (a read-only manager, items not restored), gin
    every search path it tries as an error; failures raise. The CLI hides these logs for the
    whole run, a notebook only while t5tpu works."""
    root = std_logging.getLogger()
    verbosity, root_level = logging.get_verbosity(), root.level
    logging.set_verbosity(logging.FATAL)  # absl's handler, when absl.app runs the process
    root.setLevel(std_logging.CRITICAL)  # Python's root logger, which gin and absl log to
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        root.setLevel(root_level)


class _NoVocabulary:
    """Stands in for the vocabulary of a checkpoint that does not say which it is: ids in and
    out work (EOS is 1 in every T5 vocabulary); text does not."""

    vocab_size = 0
    eos_id = 1
    pad_id = 0
