"""`t5tpu infer`: decode a text file (one model input per line) or a task split to JSONL.

One output file per checkpoint step: MODEL_DIR/inference/<source>-<step>.jsonl with
{"input", "prediction"} and "target" when the source knows it (<source>-<step>.2.jsonl and on
when a file of that name holds other inputs' predictions). Files are written to a temporary
name and renamed, so an interrupted run never leaves a half-written result in their place.
"""

from __future__ import annotations

import itertools
import json
import os

import jax
import numpy as np
import seqio
import tensorflow as tf

from t5tpu import gin_setup
from t5tpu.data import availability, batches, pipeline, registry
from t5tpu.errors import UserError
from t5tpu.model import decoding
from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.partitioning import Partitioner
from t5tpu.storage import checkpoints
from t5tpu.training import trainer


def _read_lines(path: str) -> list[str]:
    if not tf.io.gfile.exists(path):
        raise UserError(f"input file not found: {path}; set INFER_INPUT_FILE to a text file")
    with tf.io.gfile.GFile(path) as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    if not lines:
        raise UserError(f"input file {path} has no non-empty lines; put one input per line")
    return lines


def _examples_from_texts(texts: list[str], vocabulary, input_length: int) -> list[dict]:
    """Model inputs given as text (already in the task's format, e.g. 'question: ... context:
    ...'), truncated to the input length with EOS kept, as the tasks' preprocessing does."""
    return [
        {"input": text, "ids": vocabulary.encode(text)[: input_length - 1] + [vocabulary.eos_id]}
        for text in texts
    ]


def _examples_from_task(
    task_name: str, split: str, task_feature_lengths, num_examples: int | None
) -> list[dict]:
    task = registry.get_task(task_name)
    if isinstance(task, seqio.Mixture):
        names = ", ".join(t.name for t in task.tasks)
        raise UserError(
            f"{task_name} is a mixture; infer reads one task's examples: set "
            f"MIXTURE_OR_TASK_NAME to one of {names}"
        )
    # A source is handed any split name and fails deep inside tf.data (the bundled Quora sample
    # looks for <split>.tsv), so the split is checked against the ones the task declares.
    if split not in task.splits:
        raise UserError(
            f"nothing to infer: task {task_name!r} has no {split!r} split; set INFER_SPLIT to a "
            f"split the task has: {', '.join(task.splits)}"
        )
    availability.check_readable(task_name, split, "INFER_SPLIT")
    return _read_split(task, split, task_feature_lengths, num_examples)


def _read_split(task, split: str, task_feature_lengths, num_examples: int | None) -> list[dict]:
    """The first `num_examples` (None: all) examples of the split, in the source's order."""
    ds = task.get_dataset(dict(task_feature_lengths), split=split, shuffle=False, num_epochs=1)
    if num_examples is not None:
        ds = ds.take(num_examples)
    return [
        {
            "input": ex["inputs_pretokenized"].decode(),
            "target": ex["targets_pretokenized"].decode(),
            "ids": ex["inputs"].tolist(),
        }
        for ex in ds.as_numpy_iterator()
    ]


def _write_jsonl(path: str, rows: list[dict]) -> None:
    tf.io.gfile.makedirs(os.path.dirname(path))
    tmp = f"{path}.tmp"
    with tf.io.gfile.GFile(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tf.io.gfile.rename(tmp, path, overwrite=True)


def _inputs_in(path: str) -> list[str] | None:
    """The inputs of a predictions file, in order; None when it is not one."""
    try:
        with tf.io.gfile.GFile(path) as f:
            return [json.loads(line)["input"] for line in f if line.strip()]
    except (ValueError, KeyError, TypeError):
        return None


def _own_file(path: str, inputs: list[str]) -> str:
    """`path`, unless it holds the predictions of other inputs (an input file of the same name
    in another folder, other INFER_INPUTS): then the first of <name>.2.jsonl, <name>.3.jsonl,
    ... that is free or holds these inputs' predictions. Rerunning a command rewrites its own
    file; another input's predictions are never replaced."""
    stem, ext = os.path.splitext(path)
    for n in itertools.count(1):
        candidate = path if n == 1 else f"{stem}.{n}{ext}"
        if not tf.io.gfile.exists(candidate) or _inputs_in(candidate) == inputs:
            return candidate


def _file_name(
    source: str,
    step: int,
    num_examples: int | None,
    settings: decoding.DecodingSettings,
) -> str:
    """<source>-<step>[-first<N>][-beam<B>-alpha<A> | -temp<T>[-top<K>]-seed<S>].jsonl.

    Every setting that changes the predictions is in the name, so decoding the same inputs
    another way never replaces earlier predictions, while the same command (deterministic, seed
    included) rewrites its own file. Greedy decoding of every input keeps the plain name."""
    name = f"{source}-{step}"
    if num_examples is not None:
        name += f"-first{num_examples}"
    if settings.num_beams > 1:
        name += f"-beam{settings.num_beams}-alpha{settings.beam_alpha:g}"
    elif settings.samples:
        top = f"-top{settings.top_k}" if settings.top_k else ""
        name += f"-temp{settings.temperature:g}{top}-seed{settings.seed}"
    return f"{name}.jsonl"


@gin_setup.runner
def infer(
    *,
    model_dir: str,
    model: EncoderDecoderModel,
    task_feature_lengths: dict,
    input_file: str | None = None,
    inputs: list[str] | None = None,
    mixture_or_task_name: str | None = None,
    split: str = "validation",
    num_examples: int | None = None,
    batch_size: int = 32,
    checkpoint_step: int | str = "latest",
    temperature: float = 0.0,
    top_k: int = 0,
    num_beams: int = 1,
    beam_alpha: float = 0.6,
    random_seed: int = 0,
    mixture_or_task_module: str | None = None,
    output_dir: str | None = None,
    partitioner: Partitioner | None = None,
) -> list[str]:
    """Decodes INFER_INPUTS (texts given in gin or on the command line) or INFER_INPUT_FILE (one
    input per line) if given, else the task's split; only the first `num_examples` of them if
    that is not None. Returns the files written."""
    partitioner = partitioner or Partitioner()
    partitioner.check_batch_size("INFER_BATCH_SIZE", batch_size)
    settings = decoding.DecodingSettings(temperature, top_k, num_beams, beam_alpha, random_seed)
    settings.check(model.config.vocab_size)
    if num_examples is not None and num_examples < 1:
        raise UserError(
            f"INFER_NUM_EXAMPLES = {num_examples} must be >= 1, or None to decode every input"
        )
    input_length, target_length = pipeline.model_lengths(task_feature_lengths)
    if inputs:
        if isinstance(inputs, str):
            inputs = [inputs]
        examples = _examples_from_texts(list(inputs)[:num_examples], model.vocabulary, input_length)
        source = "inputs"
    elif input_file:
        lines = _read_lines(input_file)[:num_examples]
        examples = _examples_from_texts(lines, model.vocabulary, input_length)
        source = os.path.splitext(os.path.basename(input_file))[0]
    elif mixture_or_task_name:
        registry.get_task(mixture_or_task_name, mixture_or_task_module)
        examples = _examples_from_task(
            mixture_or_task_name, split, task_feature_lengths, num_examples
        )
        source = f"{mixture_or_task_name}_{split}"
    else:
        raise UserError(
            "nothing to infer: set INFER_INPUTS, INFER_INPUT_FILE or MIXTURE_OR_TASK_NAME"
        )
    steps = checkpoints.steps_to_restore(model_dir, checkpoint_step)

    params_shape, shardings = trainer.abstract_params(
        model, partitioner, input_length, target_length
    )
    batch_sharding = partitioner.batch_sharding()
    predict = partitioner.jit(
        lambda p, b, rng: model.predict(p, b, target_length, rng, settings),
        in_shardings=(shardings, batch_sharding, partitioner.replicated()),
        out_shardings=partitioner.replicated(),  # every host holds all predictions
    )
    tokens = np.zeros((len(examples), input_length), np.int32)
    for row, ex in enumerate(examples):
        tokens[row, : len(ex["ids"])] = ex["ids"]
    ds = tf.data.Dataset.from_tensor_slices(
        (np.arange(len(examples)), {"encoder_input_tokens": tokens})
    )
    mngr = checkpoints.manager(model_dir, read_only=True)
    for step in steps:
        checkpoints.check_geometry(mngr, step, params_shape)
    gin_setup.write_operative_config(model_dir, "infer_config.gin")
    inputs = [ex["input"] for ex in examples]
    written = []
    for step in steps:
        params = checkpoints.restore_params(mngr, step, params_shape, shardings)
        rng = jax.random.PRNGKey(random_seed)
        rows = []
        for indices, batch in batches.padded_batches(ds, batch_size):
            rng, batch_rng = jax.random.split(rng)
            out = predict(params, batches.full_batch_to_global(batch, batch_sharding), batch_rng)
            for i, ids in zip(indices, np.asarray(jax.device_get(out)), strict=False):
                ex = examples[i]
                row = {"input": ex["input"], "prediction": model.vocabulary.decode(ids.tolist())}
                if "target" in ex:
                    row["target"] = ex["target"]
                rows.append(row)
        path = os.path.join(
            output_dir or os.path.join(model_dir, "inference"),
            _file_name(source, step, num_examples, settings),
        )
        path = _own_file(path, inputs)
        written.append(path)
        if jax.process_index() != 0:  # every process decoded the same rows; one writes them
            print(f"step {step}: decoded {len(rows)} predictions; process 0 writes them")
            continue
        _write_jsonl(path, rows)
        for row in rows[:3]:
            print(json.dumps(row, ensure_ascii=False))
        print(f"step {step}: wrote {len(rows)} predictions to {path}", flush=True)
    return written
