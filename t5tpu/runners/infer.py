"""`t5tpu infer`: decode a text file (one model input per line), given inputs, or a task split
to JSONL, streamed in chunks, resumable and shardable.

One output file per checkpoint step: MODEL_DIR/inference/<source>-<step>.jsonl with
{"input", "prediction"} and "target" when the source knows it (<source>-<step>.2.jsonl and on
when a file of that name holds other inputs' predictions; runners/prediction_files.py names
them). The inputs are read lazily (runners/infer_inputs.py) and decoded INFER_CHUNK_SIZE at a
time; each finished chunk is a file of its own (runners/infer_chunks.py), so a rerun of an
interrupted command continues after the last one, INFER_NUM_SHARDS independent runs split the
chunks, and the final file, assembled from the chunks, is the same however the work was split.
Within a chunk, inputs are decoded by the engine (model/engine.py): batched by length, padded
to a few lengths, finished rows replaced by waiting ones.
INFER_OUTPUT_DIR puts the files and infer_config.gin in another folder, for a MODEL_DIR that is
read-only (runners/results_dir.py); the config is written with the first predictions.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

from t5tpu import validators
from t5tpu.config import gin_setup, runner_settings
from t5tpu.errors import UserError
from t5tpu.model import decoding_settings, engine, param_shapes
from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.partitioning import Partitioner
from t5tpu.runners import (
    example_progress,
    infer_chunks,
    infer_inputs,
    prediction_files,
    results_dir,
    run_lengths,
)
from t5tpu.storage import checkpoints
from t5tpu.storage import model_dir as paths
from t5tpu.storage.run_record import InputShaping, RunRecord
from t5tpu.tasks import shaping
from t5tpu.training import preemption


@dataclasses.dataclass(frozen=True)
class _Example:
    """A record ready to decode: the model input its text became (None for a task's record,
    which comes tokenized), its ids cut to the input length (EOS kept), and whether they had to
    be cut."""

    record: infer_inputs.Record
    model_input: str | None
    ids: tuple[int, ...]
    overlong: bool


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """How the texts become model inputs: shaped as the run's task shaped its training inputs
    (`recorded`, unless INFER_EXACT_INPUTS takes them as they are), tokenized and cut to
    `input_length` with EOS kept, as the tasks' preprocessing does."""

    vocabulary: object
    input_length: int
    target_length: int
    recorded: InputShaping
    exact: bool

    @property
    def shaping(self) -> InputShaping | None:
        return None if self.exact else self.recorded

    @property
    def exact_changes_them(self) -> bool:
        """Whether INFER_EXACT_INPUTS gives other model inputs than the run's shaping does."""
        return self.exact and self.recorded.changes_inputs

    def example(self, record: infer_inputs.Record) -> _Example:
        if record.ids is not None:  # a task's records come tokenized and cut by the task
            return _Example(record, None, record.ids, False)
        text = record.text if self.shaping is None else shaping.shape(self.shaping, record.text)
        encoded = engine.encode(self.vocabulary, text, self.input_length)
        return _Example(record, text, encoded.ids, encoded.truncated)

    @property
    def shown(self) -> bool:
        """Whether the predictions show each model input beside its input."""
        return self.shaping is not None and self.shaping.changes_inputs


def _refuse_overlong(truncation: str, source: infer_inputs.InputSource, inputs: _Inputs) -> None:
    """INFER_TRUNCATION='error': every input tokenized before any work, the first one that is
    too long named ('warn' truncates them as they are decoded)."""
    if truncation != "error":
        return
    input_length = inputs.input_length
    overlong = [
        record.where
        for record in source.read()
        if record.ids is None and inputs.example(record).overlong
    ]
    if overlong:
        raise UserError(
            f"{len(overlong)} of {source.total} inputs are longer than {input_length} tokens "
            f"(TASK_FEATURE_LENGTHS['inputs']), the first on {overlong[0]}; shorten them or "
            "raise TASK_FEATURE_LENGTHS['inputs'] (INFER_TRUNCATION='warn' truncates them)"
        )


def _warn_truncated(count: int, of: int, input_length: int) -> None:
    """INFER_TRUNCATION='warn': a prediction from a cut input may look fine and be wrong."""
    if count and jax.process_index() == 0:
        print(
            f"t5tpu: warning: {count} of {of} inputs are longer than {input_length} tokens "
            "(TASK_FEATURE_LENGTHS['inputs']) and were truncated (INFER_TRUNCATION='error' to "
            "refuse them)",
            file=sys.stderr,
            flush=True,
        )


@dataclasses.dataclass(frozen=True)
class _Checkpoints:
    """The checkpoints a run decodes with, each checked against the model's geometry before
    anything is written, and the run record of the newest (None: it records none)."""

    model_dir: str
    steps: list[int]
    params_shape: object
    shardings: object
    record: RunRecord | None

    @classmethod
    def checked(cls, model_dir: str, checkpoint_step: int | str, model, partitioner):
        from t5tpu.formats import loader  # TensorFlow's importers: not at gin parsing

        steps = checkpoints.steps_to_restore(model_dir, checkpoint_step)
        # Any lengths: parameters do not depend on them (relative positions).
        params_shape, shardings = param_shapes.sharded_abstract_params(model.config, partitioner)
        for step in steps:
            loader.in_model_dir(model_dir, step).check_geometry(params_shape)
        record = loader.in_model_dir(model_dir, max(steps)).run_record()
        return cls(model_dir, steps, params_shape, shardings, record)

    def params(self, step: int):
        from t5tpu.formats import loader

        checkpoint = loader.in_model_dir(self.model_dir, step)
        return checkpoint.load(self.params_shape, self.shardings)


class _Decoder:
    """Decodes pieces of the inputs through the engine, with one checkpoint's parameters at a
    time. Sampling draws each example from a key of its own (its index in the source), so a
    prediction never depends on which examples shared its batch."""

    def __init__(
        self,
        *,
        model: EncoderDecoderModel,
        partitioner: Partitioner,
        param_shardings,
        settings: decoding_settings.DecodingSettings,
        lengths: tuple[int, int],
        batch_size: int,
    ):
        self.lengths = lengths
        self.input_length = lengths[0]
        self.batch_size = batch_size
        self.settings = settings
        self.vocabulary = model.vocabulary
        self.request = engine.Request(settings, max_length=lengths[1])
        self._engine_args = dict(
            model=model,
            param_shardings=param_shardings,
            partitioner=partitioner,
            batch_size=batch_size,
            max_input_length=lengths[0],
            max_target_length=lengths[1],
            pinned=self.request,
        )
        self._engine: engine.Engine | None = None
        self._fill = None  # rows a bucket needs for programs of its own; all, once compiled

    def use(self, params) -> None:
        """Decodes with `params` from now on (the compiled programs are kept)."""
        if self._engine is None:
            self._engine = engine.Engine(params=params, **self._engine_args)
        else:
            self._engine.set_params(params)

    def compile_every_bucket(self) -> None:
        """Compiles the programs of each padded length now: compiling takes more host memory
        than decoding, so a long run that met a rare long input late would reach its peak then;
        compiled first, the peak is the same for any input count."""
        self._engine.warm_up(self.request, counts=[self._engine.batch_size])
        self._fill = 0

    def lines(
        self, span: infer_chunks.Span, examples: list[_Example], stop, *, shown: bool
    ) -> list[str] | None:
        """One JSON line per example, in input order (with its model input when `shown`); None
        when `stop()` says so (the piece is then decoded again by the next run)."""
        rows = (
            engine.Row(ex.ids, index=span.start + i, seed=self.settings.seed, tag=i)
            for i, ex in enumerate(examples)
        )
        fill = self._engine.few_rows if self._fill is None else self._fill
        feed = engine.ListFeed(rows, bucket=self._engine.bucket, fill=fill)
        predictions = {
            decoded.row.tag: decoded
            for decoded in self._engine.stream(feed, self.request, stop=stop)
        }
        if len(predictions) < len(examples):
            return None
        return [self._line(ex, predictions[i], shown=shown) for i, ex in enumerate(examples)]

    def _line(self, example: _Example, decoded: engine.Decoded, *, shown: bool) -> str:
        decode = self.vocabulary.decode
        prediction, scores = decode(decoded.ids.tolist()), None
        if self.settings.num_return_sequences > 1:
            prediction = [decode(ids.tolist()) for ids in decoded.sequences]
            scores = [round(float(score), 6) for score in decoded.scores]
        return prediction_files.json_line(
            example.record.text,
            prediction,
            example.record.target,
            model_input=example.model_input if shown else None,
            scores=scores,
        )


def _check_settings(
    settings: decoding_settings.DecodingSettings,
    model: EncoderDecoderModel,
    num_examples: int | None,
    truncation: str,
    chunk: infer_chunks.Assignment,
    exact: bool,
) -> None:
    """The macros' own limits (config.macro_limits) again, for values bound to infer.* directly,
    and what no single macro can check: the shard among the shards, TOP_K within the model's
    vocabulary."""
    settings.check(model.config.vocab_size)
    validators.optional(validators.whole(low=1)).check("INFER_NUM_EXAMPLES", num_examples)
    validators.boolean().check("INFER_EXACT_INPUTS", exact)
    validators.choice(runner_settings.TRUNCATION).check("INFER_TRUNCATION", truncation)
    validators.whole(low=1).check("INFER_CHUNK_SIZE", chunk.chunk_size)
    validators.whole(low=1).check("INFER_NUM_SHARDS", chunk.num_shards)
    validators.whole(low=0, high=chunk.num_shards - 1).check("INFER_SHARD_ID", chunk.shard_id)


@dataclasses.dataclass
class _Counted:
    """An iterator that counts what it hands out: the number of inputs, once read through."""

    items: object
    count: int = 0

    def __iter__(self):
        for item in self.items:
            self.count += 1
            yield item


def _agreed(spans: list[infer_chunks.Span]) -> list[infer_chunks.Span]:
    """Process 0's list of finished chunks, on every process (a local MODEL_DIR is on process
    0's disk only, and all of them must decode the same pieces together)."""
    if jax.process_count() == 1:
        return spans
    count = int(multihost_utils.broadcast_one_to_all(np.int64(len(spans))))
    flat = np.array([[s.start, s.end] for s in spans] or np.zeros((0, 2)), np.int64)
    flat = multihost_utils.broadcast_one_to_all(np.resize(flat, (count, 2)))
    return [infer_chunks.Span(int(a), int(b)) for a, b in np.asarray(flat)]


@dataclasses.dataclass(frozen=True)
class _Run:
    """What every checkpoint step of one infer run shares."""

    source: infer_inputs.InputSource
    inputs: _Inputs
    decoder: _Decoder
    assignment: infer_chunks.Assignment
    settings: decoding_settings.DecodingSettings
    num_examples: int | None
    output_dir: str  # INFER_OUTPUT_DIR, else MODEL_DIR

    @property
    def folder(self) -> str:
        return paths.inference_dir(self.output_dir)

    def manifest(self, step: int) -> dict:
        """Everything a chunk's predictions depend on: chunks made under other values are
        never mixed with these."""
        return {
            "inputs": self.source.fingerprint,
            "step": step,
            "settings": dataclasses.asdict(self.settings),
            "lengths": [self.decoder.input_length, self.decoder.lengths[1]],
            "batch_size": self.decoder.batch_size,
            "chunk_size": self.assignment.chunk_size,
            "shaping": self.inputs.shaping.record() if self.inputs.shaping else "exact",
        }


def _decode_chunks(run: _Run, store, progress, watch) -> tuple[int, int, bool]:
    """Decodes this run's missing chunks into `store`; returns (inputs read, inputs truncated,
    whether SIGTERM stopped it)."""
    writer = jax.process_index() == 0
    records = _Counted(run.source.read())
    done = _agreed(store.open(writer=writer))
    progress.already = sum(span.end - span.start for span in done)
    truncated = 0
    pieces = infer_chunks.pieces(records, assignment=run.assignment, done=done)
    for number, (span, piece) in enumerate(pieces):
        examples = [run.inputs.example(record) for record in piece]
        truncated += sum(ex.overlong for ex in examples)
        lines = run.decoder.lines(span, examples, stop=watch.requested, shown=run.inputs.shown)
        if lines is None:
            return records.count, truncated, True
        if writer:
            store.write(span, lines)
            if number == 0 and not done:
                sys.stdout.write("".join(lines[:3]))
        progress.add(len(piece))
    return records.count, truncated, False


def _decode_step(run: _Run, restorable: _Checkpoints, step: int, watch) -> str | None:
    """The predictions of checkpoint `step`: the final file's path once every chunk is done,
    None while other shards' chunks are missing or after SIGTERM."""
    path = prediction_files.predictions_path(
        run.folder,
        run.source.name,
        step,
        num_examples=run.num_examples,
        settings=run.settings,
        inputs=infer_inputs.Texts(run.source),
        exact_inputs=run.inputs.exact_changes_them,
    )
    store = infer_chunks.ChunkStore(path, run.manifest(step))
    run.decoder.use(restorable.params(step))
    if run.source.total is None or run.source.total > run.assignment.chunk_size:
        run.decoder.compile_every_bucket()
    progress = example_progress.ExampleProgress(f"infer step {step}", total=run.source.total)
    read, truncated, stopped = _decode_chunks(run, store, progress, watch)
    _warn_truncated(truncated, progress.count, run.decoder.input_length)
    if stopped:
        print(
            f"t5tpu: SIGTERM: stopped with {progress.already + progress.count:,} inputs' "
            "predictions saved; rerun the same command to continue",
            flush=True,
        )
        return None
    return _finish(store, step=step, read=read, progress=progress, truncated=truncated)


def _finish(store, *, step: int, read: int, progress, truncated: int) -> str | None:
    if jax.process_index() != 0:
        print(f"step {step}: decoded {progress.count} predictions; process 0 writes them")
        return store.final_path
    store.record_end(read)
    spans = store.complete()
    if spans is None:
        missing = read - sum(s.end - s.start for s in store.done())
        print(
            f"step {step}: this shard's chunks are done; {missing:,} inputs wait for the other "
            "shards (the last to finish writes the predictions file)",
            flush=True,
        )
        return None
    store.merge(spans)
    print(
        f"step {step}: wrote {read} predictions to {store.final_path} ({progress.count:,} "
        f"decoded in {progress.seconds:.1f} s, {progress.rate:.1f} examples/s, {truncated} "
        "truncated)",
        flush=True,
    )
    return store.final_path


class _StopWatch:
    """SIGTERM, looked for after each piece; with several processes the hosts agree on it at
    sync points numbered across the whole run."""

    def __init__(self):
        self._watch = preemption.PreemptionWatch()
        self._ticks = itertools.count()

    def requested(self) -> bool:
        return self._watch.requested(next(self._ticks))

    def close(self) -> None:
        self._watch.close()


def _decode_each(run: _Run, restorable: _Checkpoints, output_dir: str) -> list[str]:
    """Decodes with each checkpoint in turn; the operative config goes to
    OUTPUT/infer_config.gin with the first predictions (a run that fails before them keeps the
    earlier run's). Returns the files written."""
    written = []
    watch = _StopWatch()
    try:
        for step in restorable.steps:
            path = _decode_step(run, restorable, step, watch)
            if path is None:
                break
            written.append(path)
            if len(written) == 1:
                results_dir.write_config(paths.infer_config(output_dir))
    finally:
        watch.close()
    return written


@gin_setup.runner
def infer(
    *,
    model_dir: str,
    model: EncoderDecoderModel,
    task_feature_lengths: dict | None = None,
    input_file: str | None = None,
    inputs: list[str] | None = None,
    mixture_or_task_name: str | None = None,
    split: str = "validation",
    num_examples: int | None = None,
    batch_size: int = 32,
    chunk_size: int = 4096,
    shard_id: int = 0,
    num_shards: int = 1,
    checkpoint_step: int | str = "latest",
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    num_beams: int = 1,
    beam_alpha: float = 0.6,
    random_seed: int = 0,
    repetition_penalty: float = 1.0,
    no_repeat_ngram_size: int = 0,
    min_new_tokens: int = 0,
    num_return_sequences: int = 1,
    length_penalty: float | None = None,
    mixture_or_task_module: str | None = None,
    output_dir: str | None = None,
    truncation: str = "warn",
    exact_inputs: bool = False,
    partitioner: Partitioner | None = None,
) -> list[str]:
    """Decodes INFER_INPUTS, else INFER_INPUT_FILE (one per line), else the task's split: the
    first `num_examples` (None: all), `chunk_size` at a time, shard `shard_id` of `num_shards`'
    chunks, into `output_dir` (else MODEL_DIR), texts shaped as the run's (_Inputs)."""
    partitioner = partitioner or Partitioner()
    partitioner.check_batch_size("INFER_BATCH_SIZE", batch_size)
    settings = decoding_settings.of_arguments(locals())
    assignment = infer_chunks.Assignment(chunk_size, shard_id, num_shards)
    _check_settings(settings, model, num_examples, truncation, assignment, exact_inputs)
    output_dir = results_dir.checked_output_dir(model_dir, output_dir, "INFER_OUTPUT_DIR")
    given = infer_inputs.given(inputs=inputs, input_file=input_file, num_examples=num_examples)
    restorable = _Checkpoints.checked(model_dir, checkpoint_step, model, partitioner)
    texts = _texts(restorable.record, task_feature_lengths, model.vocabulary, exact_inputs)
    task = {"task_module": mixture_or_task_module, "split": split, "num_examples": num_examples}
    source = given or _task_source(mixture_or_task_name, texts, **task)
    _refuse_overlong(truncation, source, texts)
    _say(_plan(texts, from_task=given is None))
    decoder = _Decoder(
        model=model,
        partitioner=partitioner,
        param_shardings=restorable.shardings,
        settings=settings,
        lengths=(texts.input_length, texts.target_length),
        batch_size=batch_size,
    )
    run = _Run(source, texts, decoder, assignment, settings, num_examples, output_dir)
    return _decode_each(run, restorable, output_dir)


def _task_source(name: str | None, texts: _Inputs, **task):
    """The task's split as infer's inputs, at the lengths the texts are cut to."""
    lengths = {"inputs": texts.input_length, "targets": texts.target_length}
    return infer_inputs.from_task_named(name, feature_lengths=lengths, **task)


def _texts(record: RunRecord | None, told: dict | None, vocabulary, exact: bool) -> _Inputs:
    """How texts become model inputs: the lengths TASK_FEATURE_LENGTHS gives, else the run's,
    and the run's shaping (exact: none)."""
    lengths = run_lengths.chosen(
        told, record, setting="TASK_FEATURE_LENGTHS", say=_say, default=None
    )
    recorded = record.shaping if record else InputShaping()
    return _Inputs(vocabulary, *lengths, recorded, exact=exact)


def _say(message: str) -> None:
    if jax.process_index() == 0:
        print(message, flush=True)


def _plan(texts: _Inputs, *, from_task: bool) -> str:
    """What infer does with the inputs, in one line."""
    if from_task:
        shaped = "made by the task"
    elif texts.exact:
        shaped = "taken as given (INFER_EXACT_INPUTS)"
    else:
        shaped = shaping.describe(texts.recorded)
        if texts.recorded.changes_inputs:
            shaped += " (INFER_EXACT_INPUTS=True takes them as given)"
    return (
        f"infer: inputs of up to {texts.input_length} tokens, {shaped}; outputs of up to "
        f"{texts.target_length}"
    )
