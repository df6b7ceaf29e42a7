"""The one decoding and scoring engine: `t5tpu infer`, `t5tpu eval` (and training's periodic
eval), the Python API, `t5tpu serve` and `t5tpu bench` all run their rows through it.

Everything between rows of token ids and compiled programs lives here, once:
- inputs are padded to a few lengths (`bucket_length`: powers of two) and a server's batches to
  a few row counts (`slot_counts`: the batch size and its quarters; others use the batch size
  alone), so a few programs serve every call: per row count and input bucket, an insertion and
  a segment (slot_batch.py), all compiled by `warm_up` before a server takes requests;
- greedy and sampled decoding are continuous: a batch is a set of slots, and a row that finishes
  (EOS or the length limit) leaves it at the next segment boundary while waiting inputs of the
  same padded length take its slot, so the batch never decodes on for its longest row with the
  others idle; beam search decodes a batch to its end;
- sampling draws each input from a key of its own, `fold_in(PRNGKey(seed), index)`, so what
  an input decodes to never depends on its batch mates, its slot or when it joined;
- parameters are cast once, here, to the model's activation dtype (bf16 weights are read by
  every decoding step: half the memory traffic of float32), a bf16 embedding table held as its
  bits (layers.embeddings_as_bits); on CPU a bf16 model's decoder kernels are held a second
  time, transposed, for the feature-major step its segments run (model/feature_major.py);
- compiled programs are kept per (kind, settings, shape): the pinned settings' for good, a
  bounded number of other settings' by last use.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from t5tpu.model import (
    decoding,
    decoding_settings,
    feature_major,
    layers,
    precision,
    sample_copies,
    slot_batch,
)
from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.partitioning import Partitioner

SHORTEST_BUCKET = 16
# Threads that compile a warm-up's programs at once (each XLA compile keeps about one core busy).
_COMPILE_THREADS = 4
# A known list's bucket that fills fewer batches than this is merged into a longer one.
_FEW_BATCHES = 4
# Settings other than the pinned ones whose programs are kept (each has one program per shape).
_KEPT_SETTINGS = 8


def bucket_length(length: int, limit: int) -> int:
    """The padded length for `length` tokens: the next power of two (at least SHORTEST_BUCKET),
    within `limit`."""
    padded = max(SHORTEST_BUCKET, 1 << max(length - 1, 0).bit_length())
    return min(padded, limit)


def input_buckets(limit: int) -> tuple[int, ...]:
    """Every padded length `bucket_length` gives within `limit`, shortest first."""
    return tuple(sorted({bucket_length(n, limit) for n in range(1, limit + 1)}))


@dataclasses.dataclass(frozen=True)
class Row:
    """One input to decode: its ids (ending in EOS), its index among the caller's inputs and the
    seed (together its sampling key), a tag the caller gets back with its output, and its own
    values (temperature, top_k, top_p, the penalties: decoding.RowSettings; None: the
    request's), with which rows of other values decode in one batch."""

    ids: tuple[int, ...]
    index: int = 0
    seed: int = 0
    tag: object = None
    settings: decoding_settings.DecodingSettings | None = None


@dataclasses.dataclass(frozen=True)
class Decoded:
    """A row's output: [max_length] ids ending at EOS (included), zeros after; with `state`
    "decoding" its ids so far (Engine.stream's `partial`), "left" those it had when its caller
    left (`left`)."""

    row: Row
    ids: np.ndarray
    state: str = "finished"
    # Beam search's num_return_sequences best, or as many samples ([n, max_length], best
    # first), and the summed log-probability of each, EOS included (None otherwise).
    sequences: np.ndarray | None = None
    scores: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Request:
    """What to decode with: how tokens are picked, and the most tokens a row may take."""

    settings: decoding_settings.DecodingSettings
    max_length: int

    @property
    def family(self) -> tuple:
        """The programs these settings share: greedy's and sampling's (their values are
        inputs of the programs, each slot's own: any temperature, top_k, top_p, penalties and
        seed share them), or beam search's of its width (length penalty and each row's length
        limit are its inputs too)."""
        if self.settings.num_beams > 1:
            return ("beam", self.settings.num_beams, self.max_length)
        return ("decode", self.max_length)


class Feed(Protocol):
    """Where a continuous batch takes its rows from: `next_bucket` is the padded length of the
    next waiting row (None when none waits), `take` hands out up to `count` rows of a bucket
    that are waiting now (never blocks)."""

    def next_bucket(self) -> int | None: ...

    def take(self, count: int, bucket: int) -> list[Row]: ...


def fitted_buckets(
    bucket: Callable[[int], int], lengths: Iterable[int], *, fill: int
) -> Callable[[int], int]:
    """`bucket`, with each padded length that fewer than `fill` of `lengths` take merged into
    the next longer one: a shape's programs cost more to compile than a few rows' padding."""
    counts = collections.Counter(bucket(n) for n in lengths)
    longest, merged, carried, held = max(counts, default=0), {}, 0, []
    for padded in sorted(counts):
        carried += counts[padded]
        held.append(padded)
        if carried >= fill or padded == longest:
            merged.update(dict.fromkeys(held, padded))
            carried, held = 0, []

    def fitted(length: int) -> int:
        padded = bucket(length)
        return merged.get(padded, padded)

    return fitted


class ListFeed:
    """A Feed over a list of rows, shortest first (rows of a bucket run together). With `fill`,
    a bucket of fewer rows than that joins a longer one (fitted_buckets)."""

    def __init__(self, rows: Iterable[Row], *, bucket: Callable[[int], int], fill: int = 0):
        self._rows = collections.deque(sorted(rows, key=lambda row: len(row.ids)))
        self._bucket = fitted_buckets(bucket, (len(r.ids) for r in self._rows), fill=fill)

    def next_bucket(self) -> int | None:
        return self._bucket(len(self._rows[0].ids)) if self._rows else None

    def take(self, count: int, bucket: int) -> list[Row]:
        taken = []
        while self._rows and len(taken) < count and self.next_bucket() == bucket:
            taken.append(self._rows.popleft())
        return taken


class _Programs:
    """Compiled programs by (family, shape): the pinned family's kept, the others' dropped
    least recently used first once more than _KEPT_SETTINGS families have programs."""

    def __init__(self, *, pinned: tuple | None):
        self._pinned = pinned
        self._families: collections.OrderedDict[tuple, dict] = collections.OrderedDict()
        self._lock = threading.Lock()  # warm-up builds programs in several threads

    def get(self, family: tuple, shape: tuple, build):
        with self._lock:
            if (found := self._families.get(family, {}).get(shape)) is not None:
                self._families.move_to_end(family)
                return found
        built = build()
        with self._lock:
            programs = self._families.setdefault(family, {})
            self._families.move_to_end(family)
            programs.setdefault(shape, built)
            others = [f for f in self._families if f != self._pinned]
            for stale in others[: max(0, len(others) - _KEPT_SETTINGS)]:
                del self._families[stale]
            return programs[shape]

    def has(self, family: tuple, shape: tuple) -> bool:
        with self._lock:
            return shape in self._families.get(family, {})

    def __len__(self) -> int:
        return sum(len(programs) for programs in self._families.values())


def slot_counts(batch_size: int, data_parallelism: int) -> tuple[int, ...]:
    """The row counts a server's batches take: the batch size and each quarter of the one above
    (32: 2, 8, 32), each rounded up to a multiple of the devices (each takes an equal share).
    Quarters, not halves: every count multiplies the programs, and a batch a quarter full
    decodes about as fast per row on a CPU as a full one of the next smaller count."""
    sizes, size = {batch_size}, batch_size
    while size >= 4:
        size //= 4
        sizes.add(size)
    return tuple(sorted({-(-size // data_parallelism) * data_parallelism for size in sizes}))


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A text's ids, cut to the length limit with EOS kept (as the tasks' preprocessing cuts
    them), and how many tokens it had (EOS included)."""

    ids: tuple[int, ...]
    tokens: int

    @property
    def truncated(self) -> bool:
        return self.tokens > len(self.ids)


def encode(vocabulary, text: str, limit: int) -> Encoded:
    """`text`'s ids ending in EOS, cut to `limit` tokens with EOS kept."""
    ids = vocabulary.encode(text)
    return Encoded(ids=(*ids[: limit - 1], vocabulary.eos_id), tokens=len(ids) + 1)


@dataclasses.dataclass(frozen=True)
class _BatchEnd:
    """How a continuous batch ended: `stop()` said so, or rows it took but left to a larger
    batch (`held`, of `bucket`)."""

    stopped: bool = False
    held: tuple[Row, ...] = ()
    bucket: int = 0


@dataclasses.dataclass(frozen=True)
class _Watch:
    """Which rows of a stream are yielded as they stand after each segment (`partial`), and
    which have lost their callers and leave their slots (`left`)."""

    partial: Callable[[Row], bool] | None = None
    left: Callable[[Row], bool] | None = None

    def looked_at(self, batch: slot_batch.SlotBatch, segment: slot_batch.Segment):
        """The rows still decoding after `segment`: those left freed, those wanted yielded."""
        leaving = [(row, ids) for row, ids in segment.decoding if self.left and self.left(row)]
        batch.free([row for row, _ in leaving])
        yield from (Decoded(row, ids, "left") for row, ids in leaving)
        if self.partial is not None:
            gone = {id(row) for row, _ in leaving}
            for row, ids in segment.decoding:
                if id(row) not in gone and self.partial(row):
                    yield Decoded(row, ids, "decoding")


@dataclasses.dataclass(frozen=True)
class _Continuous:
    """A continuous batch's first rows and how it runs (Engine.stream's arguments)."""

    rows: list
    bucket: int
    poll_steps: int | None
    stop: Callable[[], bool]
    watch: _Watch


class Engine:
    """A model and its parameters, run on rows of ids (see the module docstring)."""

    def __init__(
        self,
        *,
        model: EncoderDecoderModel,
        params,
        param_shardings,
        partitioner: Partitioner,
        batch_size: int,
        max_input_length: int,
        max_target_length: int,
        pinned: Request | None = None,
        smaller_batches: bool = False,
        param_view: Callable | None = None,
        cast: bool = True,
    ):
        self.model = model
        self.partitioner = partitioner
        # Applied to the parameters inside every program (a served LoRA adapter's base rounded
        # as its run trained on it), so the arrays held stay the ones shared with others.
        self._param_view = param_view
        self.max_input_length = max_input_length
        self.max_target_length = max_target_length
        # cast=False: decode with the parameters as given (training's float32 master copy,
        # which eval reads without holding a second, cast copy).
        self._cast = cast
        self._param_shardings = param_shardings
        self.set_params(params)
        self.states = slot_batch.StatePool(
            model=model, partitioner=partitioner, param_view=param_view
        )
        self._programs = _Programs(pinned=None if pinned is None else pinned.family)
        self.smaller_batches = smaller_batches
        counts = slot_counts(batch_size, partitioner.data_parallelism)
        self.slot_counts = counts if smaller_batches else counts[-1:]

    def serve(self, *, batch_size: int, pinned: Request) -> None:
        """Set up for a server: batches of any of `slot_counts` rows (the fewest that hold the
        rows waiting when a batch starts), and `pinned`'s programs (the server's defaults) kept
        for good."""
        self.slot_counts = slot_counts(batch_size, self.partitioner.data_parallelism)
        self.smaller_batches = True
        self._programs = _Programs(pinned=pinned.family)

    @property
    def batch_size(self) -> int:
        return self.slot_counts[-1]

    @property
    def program_count(self) -> int:
        return len(self._programs)

    def programs_needed(self, request: Request) -> int:
        """How many programs `warm_up(request)` compiles: per row count and input bucket, an
        insertion and a segment (greedy, sampling) or one beam search."""
        per_shape = 1 if request.settings.num_beams > 1 else 2
        return len(self.slot_counts) * len(input_buckets(self.max_input_length)) * per_shape

    def bucket(self, length: int, limit: int | None = None) -> int:
        return bucket_length(length, limit or self.max_input_length)

    @property
    def few_rows(self) -> int:
        """Fewer rows than this in a bucket of a known list (generate, score, eval) are padded
        into a longer bucket than compile programs of their own."""
        return _FEW_BATCHES * self.batch_size

    def slots_for(self, rows: int) -> int:
        """The row count a batch of `rows` is padded to: the batch size, or with
        `smaller_batches` (a server's light load) the smallest of `slot_counts` that holds them."""
        if not self.smaller_batches:
            return self.batch_size
        return next((n for n in self.slot_counts if n >= rows), self.batch_size)

    def encode(self, text: str, limit: int | None = None) -> Encoded:
        """`text`'s ids, cut to `limit` (default: the longest input)."""
        return encode(self.model.vocabulary, text, limit or self.max_input_length)

    def set_params(self, params) -> None:
        """Decodes with other parameters of the same shapes (another checkpoint): the compiled
        programs are kept."""
        self.params = self._placed(params)
        # The feature-major decoding step's copy of the decoder's kernels, where it applies.
        self.step_weights = (
            feature_major.held(self.model.config, self.params, self.partitioner)
            if self._cast
            else None
        )

    def _placed(self, params):
        if not self._cast:
            return params
        dtype = self.model.config.activation_dtype
        cast = precision.cast_params(params, dtype, self._param_shardings)
        return layers.embeddings_as_bits(cast)

    # --- decoding ---------------------------------------------------------------------------

    def generate(self, rows: Sequence[Sequence[int]], request: Request, *, first: int = 0):
        """Decoded ids ([max_length] each) of `rows`, in order; row i samples with the key of
        index first + i."""
        return [decoded.ids for decoded in self.decoded(rows, request, first=first)]

    def decoded(
        self, rows: Sequence[Sequence[int]], request: Request, *, first: int = 0
    ) -> list[Decoded]:
        """generate's Decoded rows, in order (with beam search's n best and their scores)."""
        seed = request.settings.seed
        feed = ListFeed(
            (Row(tuple(ids), first + i, seed, tag=i) for i, ids in enumerate(rows)),
            bucket=self.bucket,
            fill=self.few_rows,
        )
        out: list[Decoded | None] = [None] * len(rows)
        for decoded in self.stream(feed, request):
            out[decoded.row.tag] = decoded
        return out

    def stream(
        self,
        feed: Feed,
        request: Request,
        *,
        poll_steps: int | None = None,
        stop: Callable[[], bool] = lambda: False,
        partial: Callable[[Row], bool] | None = None,
        left: Callable[[Row], bool] | None = None,
    ) -> Iterator[Decoded]:
        """Decodes the feed's rows as they come, each yielded when it finishes. Greedy and
        sampling run continuously: a batch takes waiting rows of its padded length whenever a
        quarter of its slots are free (a server's: whenever one is), and, with `poll_steps`,
        looks for newly waiting rows at least that often. After each segment, rows `partial`
        accepts are yielded as they stand ("decoding"), and rows `left` accepts leave their
        slots ("left"). Beam search decodes batches to their end. `stop()` is asked after each
        batch or segment; True ends the stream there (rows in flight are dropped)."""
        if request.settings.num_beams == 1 and request.settings.num_return_sequences > 1:
            yield from self._samples(feed, request, poll_steps=poll_steps, stop=stop, left=left)
            return
        watch = _Watch(partial=partial, left=left)
        end = _BatchEnd()
        while end.held or (bucket := feed.next_bucket()) is not None:
            if end.held:
                bucket, rows = end.bucket, list(end.held)
            else:
                rows = feed.take(self.batch_size, bucket)
            if not rows:
                continue
            if request.settings.num_beams > 1:
                yield from self._beam_batch(rows, bucket, request, self.slots_for(len(rows)))
                end = _BatchEnd(stopped=stop())
            else:
                continuous = _Continuous(rows, bucket, poll_steps, stop, watch)
                end = yield from self._continuous(feed, request, continuous)
            if end.stopped:
                return

    def _samples(self, feed: Feed, request: Request, **stream) -> Iterator[Decoded]:
        """num_return_sequences samples of each row (model/sample_copies.py), yielded with
        `sequences` and `scores` as beam search's n best are, when the row's last is done."""
        n = request.settings.num_return_sequences
        one = dataclasses.replace(request.settings, num_return_sequences=1)
        copies, gathered = sample_copies.Copies(feed, n), sample_copies.Gathered(n)
        for decoded in self.stream(copies, Request(one, request.max_length), **stream):
            row = copies.original(decoded.row)
            samples = gathered.add(row, decoded.ids, decoded.state)
            if samples == "left":
                yield Decoded(row, decoded.ids, "left")
            elif samples is not None:
                yield self._ranked(row, samples)

    def _ranked(self, row: Row, samples: list[np.ndarray]) -> Decoded:
        """A row's samples, best first by the model's log-likelihood of each."""
        eos_id = self.model.vocabulary.eos_id
        targets = [sample_copies.trimmed(ids, eos_id) for ids in samples]
        scores = self.score([row.ids] * len(samples), targets)
        order = np.argsort(-scores, kind="stable")
        sequences = np.stack(samples)[order]
        return Decoded(row, sequences[0], sequences=sequences, scores=scores[order])

    def _beam_batch(self, rows: list[Row], bucket: int, request: Request, count: int):
        program = self._program("beam", request, (count, bucket), self._build_beam)
        tokens = slot_batch.padded([row.ids for row in rows], count, bucket)
        own = [row.settings or request.settings for row in rows]
        own += [request.settings] * (count - len(rows))
        limit = np.array([s.max_new_tokens or request.max_length for s in own], np.int32)
        normalization = decoding.Normalization(
            alpha=np.array([s.beam_alpha for s in own], np.float32),
            exponent=np.array([s.length_penalty or 0.0 for s in own], np.float32),
            hf=np.array([s.length_penalty is not None for s in own]),
        )
        arrays = (self._put(a) for a in (tokens, limit, *normalization))
        hypotheses, scores = (np.asarray(out) for out in program(self.params, *arrays))
        for row, best, score, s in zip(rows, hypotheses, scores, own, strict=False):
            n = s.num_return_sequences  # padding dropped above by zip
            yield Decoded(row, best[0], sequences=best[:n], scores=score[:n])

    def has_beam_programs(self, request: Request, bucket: int) -> bool:
        """Whether beam search's programs for `bucket` exist at every row count."""
        return all(
            self._programs.has(request.family, ("beam", count, bucket))
            for count in self.slot_counts
        )

    def compile_beam(self, request: Request, bucket: int) -> None:
        """Compiles beam search's programs for `bucket` at every row count; any thread may
        (a server's does it beside the model's thread, which goes on decoding)."""
        for count in self.slot_counts:
            self._program("beam", request, (count, bucket), self._build_beam)

    def _continuous(self, feed, request, run: _Continuous):
        """Yields the rows of one continuous batch as they finish; returns its _BatchEnd. A
        server's batch that more rows wait for than it has free slots takes no more rows and
        finishes its own, so that a larger batch can take them all."""
        rows, bucket = run.rows, run.bucket
        if self.smaller_batches:  # every row waiting now: the batch's size is chosen once
            rows += feed.take(self.batch_size - len(rows), bucket)
        count = self.slots_for(len(rows))
        shape = slot_batch.Shape(count, bucket, request.max_length)
        batch = slot_batch.SlotBatch(engine=self, request=request, shape=shape)
        refill_at = 1 if self.smaller_batches else slot_batch.insert_size(count)
        may_grow = self.smaller_batches and count < self.batch_size
        held: list[Row] = []
        try:
            while True:
                batch.insert(rows)
                if not batch.live:
                    return _BatchEnd(held=tuple(held), bucket=bucket)
                free = count - len(batch.live)
                wanted = count if held else max(free + 1, refill_at)
                steps = request.max_length if held else run.poll_steps or request.max_length
                segment = batch.run(free_wanted=wanted, max_steps=steps)
                yield from (Decoded(row, ids) for row, ids in segment.finished)
                yield from run.watch.looked_at(batch, segment)
                if run.stop():
                    return _BatchEnd(stopped=True)
                free, rows = count - len(batch.live), []
                if not held and (free >= refill_at or not batch.live):
                    rows = feed.take(free + 1 if may_grow else free, bucket)
                if len(rows) > free:  # more wait than this batch holds: a larger one takes them
                    held, rows = rows, []
        finally:
            batch.close()

    def warm_up(
        self, request: Request, *, counts=None, stopping: Callable[[], bool] = lambda: False
    ) -> int:
        """Compiles `request`'s decoding programs for every padded input length and each row
        count in `counts` (default: all), until `stopping()`; returns how many programs exist.
        Continuous batches' programs are compiled in parallel first (compiling is most of the
        time, and XLA compiles one program on one core), then each runs once on padding, so
        that a call finds it in every cache jax keeps."""
        counts = counts or self.slot_counts
        if request.settings.num_beams == 1:
            self._compile_ahead(request, counts, stopping)
        for count in counts:
            for bucket in input_buckets(self.max_input_length):
                if stopping():
                    return self.program_count
                if request.settings.num_beams > 1:
                    list(self._beam_batch([Row((0,))], bucket, request, count))
                    continue
                shape = slot_batch.Shape(count, bucket, request.max_length)
                batch = slot_batch.SlotBatch(engine=self, request=request, shape=shape)
                batch.warm_up()
                batch.close()
        return self.program_count

    def _compile_ahead(self, request: Request, counts, stopping: Callable[[], bool]) -> None:
        shapes = [
            slot_batch.Shape(count, bucket, request.max_length)
            for count in counts
            for bucket in input_buckets(self.max_input_length)
        ]

        def compile_shape(shape):
            if not stopping():
                programs = self.programs_of(request, shape)
                slot_batch.compile_ahead(engine=self, programs=programs, shape=shape)

        workers = max(1, min(_COMPILE_THREADS, os.cpu_count() or 1, len(shapes)))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            list(pool.map(compile_shape, shapes))

    # --- scoring and logits -----------------------------------------------------------------

    def score(self, inputs: Sequence[Sequence[int]], targets: Sequence[Sequence[int]]):
        """float32 log-likelihood of each target (ids ending in EOS) given its input, summed
        over the target's tokens; rows batched by input length."""
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        scores = np.zeros((len(inputs),), np.float32)
        few = self.few_rows
        buckets = (
            fitted_buckets(self.bucket, map(len, inputs), fill=few),
            fitted_buckets(
                lambda n: self.bucket(n, self.max_target_length), map(len, targets), fill=few
            ),
        )
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            scores[rows] = self._score_batch(
                [inputs[i] for i in rows], [targets[i] for i in rows], buckets
            )
        return scores

    def _score_batch(self, inputs, targets, buckets) -> np.ndarray:
        count = self.slots_for(len(inputs))
        length = buckets[0](max(map(len, inputs)))
        target_length = buckets[1](max(map(len, targets)))
        target_ids = slot_batch.padded(targets, count, target_length)
        decoder_inputs = np.pad(target_ids, ((0, 0), (1, 0)))[:, :-1]  # shifted right
        arrays = (slot_batch.padded(inputs, count, length), decoder_inputs, target_ids)
        program = self._program("score", None, (count, length, target_length), self._build_score)
        out = program(self.params, *(self._put(a) for a in arrays))
        return np.asarray(out)[: len(inputs)]

    def logits(self, inputs: np.ndarray, decoder_inputs: np.ndarray) -> np.ndarray:
        """float32 [rows, decoder length, vocab] logits; shapes as given, rows in turns of the
        batch size."""
        rows, size = len(inputs), self.batch_size
        total = size * -(-rows // size)
        pad = ((0, total - rows), (0, 0))
        inputs, decoder_inputs = np.pad(inputs, pad), np.pad(decoder_inputs, pad)
        shape = (size, inputs.shape[1], decoder_inputs.shape[1])
        program = self._program("logits", None, shape, self._build_logits)
        out = []
        for start in range(0, total, size):
            turn = (inputs[start : start + size], decoder_inputs[start : start + size])
            out.append(np.asarray(program(self.params, *(self._put(a) for a in turn))))
        return np.concatenate(out)[:rows]

    # --- programs ---------------------------------------------------------------------------

    def programs_of(self, request: Request, shape: slot_batch.Shape) -> slot_batch.Programs:
        """The insert and segment programs of a slot batch of `shape`."""
        key = (shape.count, shape.bucket)

        def build(builder):
            return builder(engine=self, request=request, shape=shape)

        return slot_batch.Programs(
            insert=self._program("insert", request, key, lambda *_: build(slot_batch.build_insert)),
            segment=self._program(
                "segment", request, key, lambda *_: build(slot_batch.build_segment)
            ),
        )

    def ready_programs(self, request: Request, shape: slot_batch.Shape) -> slot_batch.Programs:
        """programs_of, both compiled at once the first time the shape is met (a warmed-up
        server has them all; an API call or infer meets its shapes as its rows come)."""
        before = self.program_count
        programs = self.programs_of(request, shape)
        if self.program_count != before:
            slot_batch.compile_ahead(engine=self, programs=programs, shape=shape, together=True)
        return programs

    def _program(self, kind, request: Request | None, shape: tuple, build):
        family = request.family if request is not None else (kind,)
        return self._programs.get(family, (kind, *shape), lambda: build(request, *shape))

    def _put(self, array: np.ndarray):
        """A host array every process holds in full, as a global array split over the data
        axis."""
        sharding = self.partitioner.batch_sharding()
        return jax.make_array_from_process_local_data(sharding, np.asarray(array), np.shape(array))

    def replicate(self, array: np.ndarray):
        """A host array every process holds in full, as a replicated global array."""
        sharding = self.partitioner.replicated()
        return jax.make_array_from_process_local_data(sharding, np.asarray(array), np.shape(array))

    def jit(self, fn, in_shardings, out_shardings=None, donate_argnums=()):
        """`fn(params, *args)` compiled with the parameters' shardings first (and viewed
        through the engine's param_view); outputs replicated unless given."""
        replicated = self.partitioner.replicated()
        if self._param_view is not None:
            fn = _viewing(fn, self._param_view)
        return self.partitioner.jit(
            fn,
            in_shardings=(self._param_shardings, *in_shardings),
            out_shardings=replicated if out_shardings is None else out_shardings,
            donate_argnums=donate_argnums,
        )

    # The traced functions close over the model only, never `self` (which holds the
    # parameters): a program kept by jax's own caches must not keep the engine alive.

    def _build_beam(self, request: Request, count: int, bucket: int):
        module, max_length = self.model.module, request.max_length
        eos_id, num_beams = self.model.vocabulary.eos_id, request.settings.num_beams

        def beam(params, tokens, limit, *normalization):
            normalization = decoding.Normalization(*normalization)
            hypotheses, scores = decoding.beam_hypotheses(
                module, params, tokens, max_length, eos_id, num_beams, normalization, limit
            )
            limit = jnp.minimum(limit, max_length)[:, None]
            likelihoods = decoding.log_likelihoods(hypotheses, scores, eos_id, normalization, limit)
            return hypotheses, likelihoods

        batch = self.partitioner.batch_sharding()
        program = self.jit(beam, (batch,) * 5)
        # Compiled here, not at its first call: a later call finds it in jax's caches, and a
        # server compiles it beside the model's thread (compile_beam).
        params = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.params
        )
        args = [((count, bucket), np.int32), ((count,), np.int32)]
        args += [((count,), np.float32), ((count,), np.float32), ((count,), np.bool_)]
        program.lower(
            params, *(jax.ShapeDtypeStruct(s, d, sharding=batch) for s, d in args)
        ).compile()
        return program

    def _build_score(self, _, count: int, length: int, target_length: int):
        model = self.model

        def score(params, inputs, decoder_inputs, targets):
            batch = {
                "encoder_input_tokens": inputs,
                "decoder_input_tokens": decoder_inputs,
                "decoder_target_tokens": targets,
            }
            return model.score(params, batch)

        return self.jit(score, (self.partitioner.batch_sharding(),) * 3)

    def _build_logits(self, _, rows: int, length: int, decoder_length: int):
        model = self.model

        def forward(params, inputs, decoder_inputs):
            batch = {"encoder_input_tokens": inputs, "decoder_input_tokens": decoder_inputs}
            return model.logits(params, batch).astype(jnp.float32)

        return self.jit(forward, (self.partitioner.batch_sharding(),) * 2)


def _viewing(fn, view):
    """`fn` called with `view(params)` for its first argument, the parameters."""

    def viewed(params, *args):
        return fn(view(params), *args)

    return viewed


def reused(current: Engine | None, *, params, **engine_args) -> Engine:
    """`current` decoding with `params` (its compiled programs kept), or a new Engine of
    `engine_args` when there is none yet: what an evaluation run at every checkpoint needs."""
    if current is None:
        return Engine(params=params, **engine_args)
    current.set_params(params)
    return current
