"""`t5tpu infer`: decode a text file (one model input per line) or a task split to JSONL.

One output file per checkpoint step: MODEL_DIR/inference/<source>-<step>.jsonl with
{"input", "prediction"} and "target" when the source knows it (<source>-<step>.2.jsonl and on
when a file of that name holds other inputs' predictions; runners/prediction_files.py names and
writes them). Files are written to a temporary name and renamed, so an interrupted run never
leaves a half-written result in their place. INFER_OUTPUT_DIR puts them and infer_config.gin in
another folder, for a MODEL_DIR that is read-only (runners/outputs.py); the config is written
with the first predictions.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import sys

import jax
import numpy as np
from etils import epath

from t5tpu.config import gin_setup
from t5tpu.data import availability, batches, pipeline
from t5tpu.errors import UserError
from t5tpu.model import decoding
from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.partitioning import Partitioner
from t5tpu.runners import outputs, prediction_files
from t5tpu.runtime.lazy_imports import seqio
from t5tpu.storage import checkpoints
from t5tpu.storage import model_dir as paths
from t5tpu.tasks import registry
from t5tpu.training import trainer


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """What one run decodes: `examples` ({"input", "ids"} and "target" when the source knows
    it), the first `num_examples` (None: all) of `source`, which names the predictions files."""

    source: str
    examples: list[dict]
    num_examples: int | None

    def predictions_path(self, folder: str, step: int, settings: decoding.DecodingSettings):
        return prediction_files.predictions_path(
            folder,
            self.source,
            step,
            num_examples=self.num_examples,
            settings=settings,
            inputs=[ex["input"] for ex in self.examples],
        )

    def overlong(self) -> list[str]:
        """Where each input that was truncated came from ('line 7 of FILE', 'INFER_INPUTS[2]')."""
        return [ex["overlong"] for ex in self.examples if "overlong" in ex]


def _read_lines(path: str) -> list[tuple[str, str]]:
    """(text, 'line N of FILE') of each non-empty line. Read as bytes and decoded here, so a
    binary file is refused in one line naming it instead of failing in the decoder."""
    availability.check_storage(path, "INFER_INPUT_FILE")
    if not epath.Path(path).is_file():
        raise UserError(f"input file not found: {path}; set INFER_INPUT_FILE to a text file")
    data = epath.Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        text = data[: e.start].decode("utf-8") + "\0"  # a NUL marks the first bad byte
    if "\0" in text:  # not UTF-8, or NULs: UTF-16 text, a binary file
        line = text.count("\n", 0, text.index("\0")) + 1
        raise UserError(
            f"INFER_INPUT_FILE {path} is not a UTF-8 text file (line {line}); give a text file "
            "with one model input per line"
        )
    # Universal newlines, as a file opened as text reads: \r\n and \r end a line too.
    lines = [
        (line.rstrip("\n"), f"line {number} of {path}")
        for number, line in enumerate(io.StringIO(text, newline=None), start=1)
        if line.strip()
    ]
    if not lines:
        raise UserError(f"input file {path} has no non-empty lines; put one input per line")
    return lines


def _examples_from_texts(texts: list[tuple[str, str]], vocabulary, input_length: int) -> list[dict]:
    """Model inputs given as (text, where it came from), the text already in the task's format
    (e.g. 'question: ... context: ...'), truncated to the input length with EOS kept, as the
    tasks' preprocessing does; a truncated one is marked with where it came from."""
    examples = []
    for text, where in texts:
        ids = vocabulary.encode(text)
        example = {"input": text, "ids": ids[: input_length - 1] + [vocabulary.eos_id]}
        if len(ids) >= input_length:  # with its EOS, longer than the input length
            example["overlong"] = where
        examples.append(example)
    return examples


def _check_truncation(inputs: _Inputs, truncation: str, input_length: int) -> None:
    """INFER_TRUNCATION: inputs longer than the input length are refused ('error'), or
    truncated with one warning saying how many ('warn'): a prediction from a cut input may look
    fine and be wrong."""
    overlong = inputs.overlong()
    if not overlong:
        return
    count = (
        f"{len(overlong)} of {len(inputs.examples)} inputs are longer than {input_length} "
        "tokens (TASK_FEATURE_LENGTHS['inputs'])"
    )
    if truncation == "error":
        raise UserError(
            f"{count}, the first on {overlong[0]}; shorten them or raise "
            "TASK_FEATURE_LENGTHS['inputs'] (INFER_TRUNCATION='warn' truncates them)"
        )
    if jax.process_index() == 0:
        print(
            f"t5tpu: warning: {count} and were truncated (INFER_TRUNCATION='error' to refuse them)",
            file=sys.stderr,
            flush=True,
        )


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


def _chosen_inputs(
    *,
    inputs: list[str] | str | None,
    input_file: str | None,
    mixture_or_task_name: str | None,
    mixture_or_task_module: str | None,
    split: str,
    task_feature_lengths,
    num_examples: int | None,
    vocabulary,
) -> _Inputs:
    """INFER_INPUTS if given, else INFER_INPUT_FILE, else the task's split: the first
    `num_examples` of them (None: all)."""
    input_length = pipeline.model_lengths(task_feature_lengths)[0]
    if inputs:
        texts = [inputs] if isinstance(inputs, str) else list(inputs)
        texts = [(text, f"INFER_INPUTS[{i}]") for i, text in enumerate(texts)]
        examples = _examples_from_texts(texts[:num_examples], vocabulary, input_length)
        return _Inputs("inputs", examples, num_examples)
    if input_file:
        lines = _read_lines(input_file)[:num_examples]
        source = os.path.splitext(os.path.basename(input_file))[0]
        return _Inputs(source, _examples_from_texts(lines, vocabulary, input_length), num_examples)
    if mixture_or_task_name:
        registry.get_task(mixture_or_task_name, mixture_or_task_module)
        examples = _examples_from_task(
            mixture_or_task_name, split, task_feature_lengths, num_examples
        )
        return _Inputs(f"{mixture_or_task_name}_{split}", examples, num_examples)
    raise UserError("nothing to infer: set INFER_INPUTS, INFER_INPUT_FILE or MIXTURE_OR_TASK_NAME")


@dataclasses.dataclass(frozen=True)
class _Checkpoints:
    """The checkpoints a run decodes with, each checked against the model's geometry before
    anything is written."""

    mngr: object
    steps: list[int]
    params_shape: object
    shardings: object

    @classmethod
    def checked(
        cls, model_dir: str, checkpoint_step: int | str, *, model, partitioner, lengths
    ) -> _Checkpoints:
        steps = checkpoints.steps_to_restore(model_dir, checkpoint_step)
        params_shape, shardings = trainer.abstract_params(model, partitioner, *lengths)
        mngr = checkpoints.manager(model_dir, read_only=True)
        for step in steps:
            checkpoints.check_geometry(mngr, step, params_shape)
        return cls(mngr, steps, params_shape, shardings)

    def params(self, step: int):
        return checkpoints.restore_params(self.mngr, step, self.params_shape, self.shardings)


def _input_tokens(examples: list[dict], input_length: int) -> np.ndarray:
    """The examples' input ids, one row each, zero-padded to the input length."""
    tokens = np.zeros((len(examples), input_length), np.int32)
    for row, ex in enumerate(examples):
        tokens[row, : len(ex["ids"])] = ex["ids"]
    return tokens


class _Decoder:
    """Decodes one run's inputs with the parameters of each checkpoint in turn."""

    def __init__(
        self,
        *,
        model: EncoderDecoderModel,
        partitioner: Partitioner,
        param_shardings,
        settings: decoding.DecodingSettings,
        lengths: tuple[int, int],
        batch_size: int,
    ):
        input_length, target_length = lengths
        self.input_length = input_length
        self.batch_size = batch_size
        self.seed = settings.seed
        self.vocabulary = model.vocabulary
        self.batch_sharding = partitioner.batch_sharding()
        self._predict = partitioner.jit(
            lambda p, b, rng: model.predict(p, b, target_length, rng, settings),
            in_shardings=(param_shardings, self.batch_sharding, partitioner.replicated()),
            out_shardings=partitioner.replicated(),  # every host holds all predictions
        )

    def rows(self, params, inputs: _Inputs) -> list[dict]:
        """{"input", "prediction"} (and "target" when known) per example, in order."""
        rng = jax.random.PRNGKey(self.seed)
        rows = []
        tokens = {"encoder_input_tokens": _input_tokens(inputs.examples, self.input_length)}
        for indices, batch in batches.padded_array_batches(tokens, self.batch_size):
            rng, batch_rng = jax.random.split(rng)
            global_batch = batches.full_batch_to_global(batch, self.batch_sharding)
            out = self._predict(params, global_batch, batch_rng)
            for i, ids in zip(indices, np.asarray(jax.device_get(out)), strict=False):
                ex = inputs.examples[i]
                row = {"input": ex["input"], "prediction": self.vocabulary.decode(ids.tolist())}
                if "target" in ex:
                    row["target"] = ex["target"]
                rows.append(row)
        return rows


def _write_predictions(path: str, rows: list[dict], step: int) -> None:
    if jax.process_index() != 0:  # every process decoded the same rows; one writes them
        print(f"step {step}: decoded {len(rows)} predictions; process 0 writes them")
        return
    prediction_files.write_jsonl(path, rows)
    for row in rows[:3]:
        print(json.dumps(row, ensure_ascii=False))
    print(f"step {step}: wrote {len(rows)} predictions to {path}", flush=True)


def _check_settings(num_examples: int | None, truncation: str) -> None:
    if num_examples is not None and num_examples < 1:
        raise UserError(
            f"INFER_NUM_EXAMPLES = {num_examples} must be >= 1, or None to decode every input"
        )
    if truncation not in ("warn", "error"):
        raise UserError(
            f"INFER_TRUNCATION = {truncation!r} must be 'warn' (truncate inputs longer than "
            "TASK_FEATURE_LENGTHS['inputs'], with a warning) or 'error' (refuse them)"
        )


def _decode_each(
    decoder: _Decoder, restorable: _Checkpoints, chosen: _Inputs, settings, output_dir: str
) -> list[str]:
    """Decodes with each checkpoint in turn into OUTPUT/inference; the operative config goes to
    OUTPUT/infer_config.gin with the first predictions (a run that fails before them keeps the
    earlier run's). Returns the files."""
    folder = paths.inference_dir(output_dir)
    written = []
    for step in restorable.steps:
        rows = decoder.rows(restorable.params(step), chosen)
        written.append(chosen.predictions_path(folder, step, settings))
        _write_predictions(written[-1], rows, step)
        if len(written) == 1:
            outputs.write_config(paths.infer_config(output_dir))
    return written


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
    truncation: str = "warn",
    partitioner: Partitioner | None = None,
) -> list[str]:
    """Decodes INFER_INPUTS (texts from gin or the command line), else INFER_INPUT_FILE (one per
    line), else the task's split: the first `num_examples` (None: all). Predictions go to
    `output_dir` (INFER_OUTPUT_DIR), else MODEL_DIR. Returns the files."""
    partitioner = partitioner or Partitioner()
    partitioner.check_batch_size("INFER_BATCH_SIZE", batch_size)
    settings = decoding.DecodingSettings(temperature, top_k, num_beams, beam_alpha, random_seed)
    settings.check(model.config.vocab_size)
    _check_settings(num_examples, truncation)
    output_dir = outputs.checked_output_dir(model_dir, output_dir, "INFER_OUTPUT_DIR")
    lengths = pipeline.model_lengths(task_feature_lengths)
    chosen = _chosen_inputs(
        inputs=inputs,
        input_file=input_file,
        mixture_or_task_name=mixture_or_task_name,
        mixture_or_task_module=mixture_or_task_module,
        split=split,
        task_feature_lengths=task_feature_lengths,
        num_examples=num_examples,
        vocabulary=model.vocabulary,
    )
    _check_truncation(chosen, truncation, lengths[0])
    restorable = _Checkpoints.checked(
        model_dir, checkpoint_step, model=model, partitioner=partitioner, lengths=lengths
    )
    decoder = _Decoder(
        model=model,
        partitioner=partitioner,
        param_shardings=restorable.shardings,
        settings=settings,
        lengths=lengths,
        batch_size=batch_size,
    )
    return _decode_each(decoder, restorable, chosen, settings, output_dir)
