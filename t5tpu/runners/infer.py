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
from t5tpu.data import pipeline
from t5tpu.errors import UserError
from t5tpu.model import decoding, engine
from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.partitioning import Partitioner
from t5tpu.runners import (
    example_progress,
    infer_chunks,
    infer_inputs,
    prediction_files,
    results_dir,
)
from t5tpu.storage import checkpoints
from t5tpu.storage import model_dir as paths
from t5tpu.training import preemption, trainer


@dataclasses.dataclass(frozen=True)
class _Example:
    """A record ready to decode: its ids cut to the input length (EOS kept), and whether they
    had to be cut."""

    record: infer_inputs.Record
    ids: tuple[int, ...]
    overlong: bool


def _encoded(record: infer_inputs.Record, vocabulary, input_length: int) -> _Example:
    """The text already in the task's format (e.g. 'question: ... context: ...'), truncated to
    the input length with EOS kept, as the tasks' preprocessing does. A task's records come
    tokenized and cut by the task."""
    if record.ids is not None:
        return _Example(record, record.ids, False)
    encoded = engine.encode(vocabulary, record.text, input_length)
    return _Example(record, encoded.ids, encoded.truncated)


def _refuse_overlong(
    truncation: str, source: infer_inputs.InputSource, vocabulary, input_length: int
) -> None:
    """INFER_TRUNCATION='error': every input tokenized before any work, the first one that is
    too long named ('warn' truncates them as they are decoded)."""
    if truncation != "error":
        return
    overlong = [
        record.where
        for record in source.read()
        if record.ids is None and _encoded(record, vocabulary, input_length).overlong
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
    anything is written."""

    model_dir: str
    steps: list[int]
    params_shape: object
    shardings: object

    @classmethod
    def checked(
        cls, model_dir: str, checkpoint_step: int | str, *, model, partitioner, lengths
    ) -> _Checkpoints:
        from t5tpu.formats import loader  # TensorFlow's importers: not at gin parsing

        steps = checkpoints.steps_to_restore(model_dir, checkpoint_step)
        params_shape, shardings = trainer.abstract_params(model, partitioner, *lengths)
        for step in steps:
            loader.in_model_dir(model_dir, step).check_geometry(params_shape)
        return cls(model_dir, steps, params_shape, shardings)

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
        settings: decoding.DecodingSettings,
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
            network=model,
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

    def lines(self, span: infer_chunks.Span, examples: list[_Example], stop) -> list[str] | None:
        """One JSON line per example, in input order; None when `stop()` says so (the piece is
        then decoded again by the next run)."""
        rows = (
            engine.Row(ex.ids, index=span.start + i, seed=self.settings.seed, tag=i)
            for i, ex in enumerate(examples)
        )
        fill = self._engine.few_rows if self._fill is None else self._fill
        feed = engine.ListFeed(rows, bucket=self._engine.bucket, fill=fill)
        predictions = {
            decoded.row.tag: decoded.ids
            for decoded in self._engine.stream(feed, self.request, stop=stop)
        }
        if len(predictions) < len(examples):
            return None
        return [
            prediction_files.json_line(
                ex.record.text, self.vocabulary.decode(predictions[i].tolist()), ex.record.target
            )
            for i, ex in enumerate(examples)
        ]


def _check_settings(
    num_examples: int | None, truncation: str, chunk: infer_chunks.Assignment
) -> None:
    """The macros' own limits (config.macro_limits) again, for values bound to infer.* directly,
    and what no single macro can check: the shard among the shards."""
    validators.optional(validators.whole(low=1)).check("INFER_NUM_EXAMPLES", num_examples)
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
    decoder: _Decoder
    assignment: infer_chunks.Assignment
    settings: decoding.DecodingSettings
    num_examples: int | None
    folder: str

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
        examples = [_encoded(r, run.decoder.vocabulary, run.decoder.input_length) for r in piece]
        truncated += sum(ex.overlong for ex in examples)
        lines = run.decoder.lines(span, examples, stop=watch.requested)
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
    task_feature_lengths: dict,
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
    num_beams: int = 1,
    beam_alpha: float = 0.6,
    random_seed: int = 0,
    mixture_or_task_module: str | None = None,
    output_dir: str | None = None,
    truncation: str = "warn",
    partitioner: Partitioner | None = None,
) -> list[str]:
    """Decodes INFER_INPUTS (texts from gin or the command line), else INFER_INPUT_FILE (one per
    line), else the task's split: the first `num_examples` (None: all), `chunk_size` at a time,
    the chunks of shard `shard_id` of `num_shards`. Predictions go to `output_dir`
    (INFER_OUTPUT_DIR), else MODEL_DIR. Returns the files written."""
    partitioner = partitioner or Partitioner()
    partitioner.check_batch_size("INFER_BATCH_SIZE", batch_size)
    settings = decoding.DecodingSettings(temperature, top_k, num_beams, beam_alpha, random_seed)
    settings.check(model.config.vocab_size)
    assignment = infer_chunks.Assignment(chunk_size, shard_id, num_shards)
    _check_settings(num_examples, truncation, assignment)
    output_dir = results_dir.checked_output_dir(model_dir, output_dir, "INFER_OUTPUT_DIR")
    lengths = pipeline.model_lengths(task_feature_lengths)
    source = infer_inputs.chosen(
        inputs=inputs,
        input_file=input_file,
        task_name=mixture_or_task_name,
        task_module=mixture_or_task_module,
        split=split,
        feature_lengths=task_feature_lengths,
        num_examples=num_examples,
    )
    _refuse_overlong(truncation, source, model.vocabulary, lengths[0])
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
    run = _Run(source, decoder, assignment, settings, num_examples, paths.inference_dir(output_dir))
    return _decode_each(run, restorable, output_dir)
