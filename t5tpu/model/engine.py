"""The decoding and scoring engine that `t5tpu infer`, the Python API and `t5tpu serve` share.

Everything between rows of token ids and compiled programs lives here, once:
- inputs are padded to a few lengths (`bucket_length`: powers of two) and batches to a few row
  counts (`Engine.slot_counts`: powers of two up to the batch size), so a few programs serve
  every call;
- greedy and sampled decoding are continuous: a batch is a set of slots, and a row that finishes
  (EOS or the length limit) leaves it at the next segment boundary while waiting inputs of the
  same padded length take its slot (`decoding.run_segment`, `decoding.insert_rows`), so the
  batch never decodes on for its longest row with the others idle; beam search decodes a batch
  to its end;
- sampling draws each input from a key of its own, `fold_in(PRNGKey(seed), index)`, so what
  an input decodes to never depends on its batch mates, its slot or when it joined;
- parameters are cast once, here, to the network's activation dtype (bf16 weights are read by
  every decoding step: half the memory traffic of float32);
- compiled programs are kept per (kind, settings, shape): the pinned settings' for good, a
  bounded number of other settings' by last use.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from t5tpu.model import decoding, precision
from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.partitioning import Partitioner

SHORTEST_BUCKET = 16
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
    seed (together its sampling key), and a tag the caller gets back with its output."""

    ids: tuple[int, ...]
    index: int = 0
    seed: int = 0
    tag: object = None


@dataclasses.dataclass(frozen=True)
class Decoded:
    """A row's output: [max_length] ids ending at EOS (included), zeros after."""

    row: Row
    ids: np.ndarray


@dataclasses.dataclass(frozen=True)
class Request:
    """What to decode with: how tokens are picked, and the most tokens a row may take."""

    settings: decoding.DecodingSettings
    max_length: int

    @property
    def family(self) -> tuple:
        """The programs these settings share (the seed only picks row keys)."""
        return ("decode", dataclasses.replace(self.settings, seed=0), self.max_length)


class Feed(Protocol):
    """Where a continuous batch takes its rows from: `next_bucket` is the padded length of the
    next waiting row (None when none waits), `take` hands out up to `count` rows of a bucket
    that are waiting now (never blocks)."""

    def next_bucket(self) -> int | None: ...

    def take(self, count: int, bucket: int) -> list[Row]: ...


class ListFeed:
    """A Feed over a list of rows, shortest first (rows of a bucket run together)."""

    def __init__(self, rows: Iterable[Row], *, bucket: Callable[[int], int]):
        self._rows = collections.deque(sorted(rows, key=lambda row: len(row.ids)))
        self._bucket = bucket

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

    def get(self, family: tuple, shape: tuple, build):
        programs = self._families.setdefault(family, {})
        self._families.move_to_end(family)
        if shape not in programs:
            programs[shape] = build()
        others = [f for f in self._families if f != self._pinned]
        for stale in others[: max(0, len(others) - _KEPT_SETTINGS)]:
            del self._families[stale]
        return programs[shape]

    def __len__(self) -> int:
        return sum(len(programs) for programs in self._families.values())


def padded(rows: Sequence[Sequence[int]], count: int, length: int) -> np.ndarray:
    """[count, length] int32 ids, rows cut to `length` and zero-padded (0 is T5's padding id,
    which the network masks out)."""
    out = np.zeros((count, length), np.int32)
    for i, ids in enumerate(rows):
        ids = list(ids)[:length]
        out[i, : len(ids)] = ids
    return out


def row_keys(rows: Sequence[Row], count: int) -> np.ndarray:
    """[count, 2] sampling keys: each row's from its seed and index (padding rows get zeros)."""
    keys = np.zeros((count, 2), np.uint32)
    by_seed = collections.defaultdict(list)
    for position, row in enumerate(rows):
        by_seed[row.seed].append(position)
    for seed, positions in by_seed.items():
        keys[positions] = decoding.row_keys(seed, [rows[p].index for p in positions])
    return keys


def slot_counts(batch_size: int, data_parallelism: int) -> tuple[int, ...]:
    """The row counts batches are padded to: powers of two below batch_size and itself, each
    rounded up to a multiple of the devices (each takes an equal share)."""
    powers = (1 << n for n in range(batch_size.bit_length()))
    sizes = {batch_size, *(size for size in powers if size < batch_size)}
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


class Engine:
    """A network and its parameters, run on rows of ids (see the module docstring)."""

    def __init__(
        self,
        *,
        network: EncoderDecoderModel,
        params,
        param_shardings,
        partitioner: Partitioner,
        batch_size: int,
        max_input_length: int,
        max_target_length: int,
        pinned: Request | None = None,
        smaller_batches: bool = False,
        param_view: Callable | None = None,
    ):
        self.network = network
        # Applied to the parameters inside every program (a served LoRA adapter's base rounded
        # as its run trained on it), so the arrays held stay the ones shared with others.
        self._param_view = param_view
        self.smaller_batches = smaller_batches
        self.max_input_length = max_input_length
        self.max_target_length = max_target_length
        self.slot_counts = slot_counts(batch_size, partitioner.data_parallelism)
        self.params = precision.cast_params(
            params, network.config.activation_dtype, param_shardings
        )
        self._param_shardings = param_shardings
        self._partitioner = partitioner
        self._programs = _Programs(pinned=None if pinned is None else pinned.family)

    def serve(self, *, batch_size: int, pinned: Request) -> None:
        """Set up for a server: batches of any of `slot_counts` rows (the fewest that hold the
        rows waiting), and `pinned`'s programs (the server's defaults) kept for good."""
        self.slot_counts = slot_counts(batch_size, self._partitioner.data_parallelism)
        self.smaller_batches = True
        self._programs = _Programs(pinned=pinned.family)

    @property
    def batch_size(self) -> int:
        return self.slot_counts[-1]

    @property
    def program_count(self) -> int:
        return len(self._programs)

    def bucket(self, length: int, limit: int | None = None) -> int:
        return bucket_length(length, limit or self.max_input_length)

    def slots_for(self, rows: int) -> int:
        """The row count a batch of `rows` is padded to: the batch size, or with
        `smaller_batches` (a server's light load) the smallest of `slot_counts` that holds them."""
        if not self.smaller_batches:
            return self.batch_size
        return next((n for n in self.slot_counts if n >= rows), self.batch_size)

    def encode(self, text: str, limit: int | None = None) -> Encoded:
        """`text`'s ids, cut to `limit` (default: the longest input)."""
        return encode(self.network.vocabulary, text, limit or self.max_input_length)

    # --- decoding ---------------------------------------------------------------------------

    def generate(self, rows: Sequence[Sequence[int]], request: Request, *, first: int = 0):
        """Decoded ids ([max_length] each) of `rows`, in order; row i samples with the key of
        index first + i."""
        seed = request.settings.seed
        feed = ListFeed(
            (Row(tuple(ids), first + i, seed, tag=i) for i, ids in enumerate(rows)),
            bucket=self.bucket,
        )
        out: list[np.ndarray | None] = [None] * len(rows)
        for decoded in self.stream(feed, request):
            out[decoded.row.tag] = decoded.ids
        return out

    def set_params(self, params) -> None:
        """Decodes with other parameters of the same shapes (another checkpoint): the compiled
        programs are kept."""
        dtype = self.network.config.activation_dtype
        self.params = precision.cast_params(params, dtype, self._param_shardings)

    def stream(
        self,
        feed: Feed,
        request: Request,
        *,
        poll_steps: int | None = None,
        stop: Callable[[], bool] = lambda: False,
    ) -> Iterator[Decoded]:
        """Decodes the feed's rows as they come, each yielded when it finishes. Greedy and
        sampling run continuously: a batch takes waiting rows of its padded length whenever a
        quarter of its slots are free, and, with `poll_steps`, looks for newly waiting rows at
        least that often. Beam search decodes batches to their end. `stop()` is asked after
        each batch or segment; True ends the stream there (rows in flight are dropped)."""
        while (bucket := feed.next_bucket()) is not None:
            rows = feed.take(self.batch_size, bucket)
            if not rows:
                continue
            if request.settings.num_beams > 1:
                yield from self._beam_batch(rows, bucket, request)
                stopped = stop()
            else:
                stopped = yield from self._continuous(feed, rows, bucket, request, poll_steps, stop)
            if stopped:
                return

    def _beam_batch(self, rows: list[Row], bucket: int, request: Request) -> Iterator[Decoded]:
        count = self.slots_for(len(rows))
        program = self._program("beam", request, (count, bucket), self._build_beam)
        tokens = self._put(padded([row.ids for row in rows], count, bucket), batch=True)
        out = np.asarray(program(self.params, tokens))
        for row, ids in zip(rows, out, strict=False):  # padding rows dropped
            yield Decoded(row, ids)

    def _continuous(self, feed, rows, bucket, request, poll_steps, stop):
        """Yields the rows of one continuous batch as they finish; returns whether `stop()`."""
        batch = _SlotBatch(self, request, count=self.slots_for(len(rows)), bucket=bucket)
        # Refilling a few slots at a time would run the encoder on a few rows at a time; a
        # batch that shrinks as rows end (a server's) answers each row as soon as it ends.
        refill_at = 1 if self.smaller_batches else max(1, batch.count // 4)
        max_steps = poll_steps or request.max_length
        while True:
            if self.smaller_batches:  # as few slots as the live and new rows need
                batch.resize(self.slots_for(len(batch.live) + len(rows)))
            if rows:
                batch.insert(rows)
            if not batch.live:
                return False
            free = batch.count - len(batch.live)
            yield from batch.run(free_wanted=max(free + 1, refill_at), max_steps=max_steps)
            if stop():
                return True
            room = (self.batch_size if self.smaller_batches else batch.count) - len(batch.live)
            wanted = batch.count - len(batch.live) >= refill_at or not batch.live
            rows = feed.take(room, bucket) if wanted or self.smaller_batches else []

    def warm_up(
        self, request: Request, *, counts=None, stopping: Callable[[], bool] = lambda: False
    ) -> int:
        """Compiles `request`'s decoding programs for every padded input length and each row
        count in `counts` (default: all), until `stopping()`; returns how many programs exist.
        Each runs once on padding (jax compiles a program at its first call)."""
        for count in counts or self.slot_counts:
            for bucket in input_buckets(self.max_input_length):
                if stopping():
                    return self.program_count
                if request.settings.num_beams > 1:
                    list(self._beam_batch([Row((0,))], bucket, request))
                else:
                    _SlotBatch(self, request, count=count, bucket=bucket).warm_up()
        return self.program_count

    # --- scoring and logits -----------------------------------------------------------------

    def score(self, inputs: Sequence[Sequence[int]], targets: Sequence[Sequence[int]]):
        """float32 log-likelihood of each target (ids ending in EOS) given its input, summed
        over the target's tokens; rows batched by input length."""
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        scores = np.zeros((len(inputs),), np.float32)
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            scores[rows] = self._score_batch([inputs[i] for i in rows], [targets[i] for i in rows])
        return scores

    def _score_batch(self, inputs, targets) -> np.ndarray:
        count = self.slots_for(len(inputs))
        length = self.bucket(max(map(len, inputs)))
        target_length = self.bucket(max(map(len, targets)), self.max_target_length)
        target_ids = padded(targets, count, target_length)
        decoder_inputs = np.pad(target_ids, ((0, 0), (1, 0)))[:, :-1]  # shifted right
        arrays = (padded(inputs, count, length), decoder_inputs, target_ids)
        program = self._program(("score",), None, (count, length, target_length), self._build_score)
        out = program(self.params, *(self._put(a, batch=True) for a in arrays))
        return np.asarray(out)[: len(inputs)]

    def logits(self, inputs: np.ndarray, decoder_inputs: np.ndarray) -> np.ndarray:
        """float32 [rows, decoder length, vocab] logits; shapes as given, rows in turns of the
        batch size."""
        rows, size = len(inputs), self.batch_size
        total = size * -(-rows // size)
        pad = ((0, total - rows), (0, 0))
        inputs, decoder_inputs = np.pad(inputs, pad), np.pad(decoder_inputs, pad)
        shape = (size, inputs.shape[1], decoder_inputs.shape[1])
        program = self._program(("logits",), None, shape, self._build_logits)
        out = []
        for start in range(0, total, size):
            turn = (inputs[start : start + size], decoder_inputs[start : start + size])
            out.append(np.asarray(program(self.params, *(self._put(a, batch=True) for a in turn))))
        return np.concatenate(out)[:rows]

    # --- programs ---------------------------------------------------------------------------

    def _program(self, kind, request: Request | None, shape: tuple, build):
        family = request.family if request is not None else kind
        return self._programs.get(family, (kind, *shape), lambda: build(request, *shape))

    def _put(self, array: np.ndarray, *, batch: bool):
        """A host array every process holds in full, as a global array: split over the data
        axis (`batch`) or replicated."""
        sharding = self._partitioner.batch_sharding() if batch else self._partitioner.replicated()
        return jax.make_array_from_process_local_data(sharding, np.asarray(array), np.shape(array))

    def _jit(self, fn, in_shardings, out_shardings=None, donate_argnums=()):
        replicated = self._partitioner.replicated()
        if self._param_view is not None:
            fn = _viewing(fn, self._param_view)
        return self._partitioner.jit(
            fn,
            in_shardings=(self._param_shardings, *in_shardings),
            out_shardings=replicated if out_shardings is None else out_shardings,
            donate_argnums=donate_argnums,
        )

    # The traced functions close over the network only, never `self` (which holds the
    # parameters): a program kept by jax's own caches must not keep the engine alive.

    def _build_beam(self, request: Request, count: int, bucket: int):
        network, settings, max_length = self.network, request.settings, request.max_length

        def beam(params, tokens):
            batch = {"encoder_input_tokens": tokens}
            return network.predict(params, batch, max_length, None, settings)

        return self._jit(beam, (self._partitioner.batch_sharding(),))

    def _build_score(self, _, count: int, length: int, target_length: int):
        network = self.network

        def score(params, inputs, decoder_inputs, targets):
            batch = {
                "encoder_input_tokens": inputs,
                "decoder_input_tokens": decoder_inputs,
                "decoder_target_tokens": targets,
            }
            return network.score(params, batch)

        return self._jit(score, (self._partitioner.batch_sharding(),) * 3)

    def _build_logits(self, _, rows: int, length: int, decoder_length: int):
        network = self.network

        def forward(params, inputs, decoder_inputs):
            batch = {"encoder_input_tokens": inputs, "decoder_input_tokens": decoder_inputs}
            return network.logits(params, batch).astype(jnp.float32)

        return self._jit(forward, (self._partitioner.batch_sharding(),) * 2)


def _viewing(fn, view):
    """`fn` called with `view(params)` for its first argument, the parameters."""

    def viewed(params, *args):
        return fn(view(params), *args)

    return viewed


class _SlotBatch:
    """One continuous batch on the devices: `count` slots of inputs padded to `bucket`, which
    rows (`live`, by slot) they hold, and the compiled programs that fill and run them."""

    def __init__(self, engine: Engine, request: Request, *, count: int, bucket: int):
        self.engine, self.request = engine, request
        self.count, self.bucket = count, bucket
        self.live: dict[int, Row] = {}
        self._empty, self._segment, self._inserts = self.compile(
            engine, request, count=count, bucket=bucket
        )
        self.state = self._empty(engine.params)

    @staticmethod
    def insert_sizes(count: int) -> tuple[int, ...]:
        """Row counts an insertion is padded to: the powers of two below `count`, and `count`.
        An insertion runs the encoder on its rows, padding included, and the encoder costs
        about as much per row in any batch on a CPU: padding must stay small."""
        return tuple(
            sorted({count, *(1 << n for n in range(count.bit_length()) if 1 << n < count)})
        )

    @classmethod
    def compile(cls, engine: Engine, request: Request, *, count: int, bucket: int):
        """The (empty, segment, {size: insert}) programs of this shape, built once."""
        shape = (count, bucket)
        empty = engine._program("empty", request, shape, _build_empty(engine))
        segment = engine._program("segment", request, shape, _build_segment(engine))
        inserts = {
            size: engine._program("insert", request, (*shape, size), _build_insert(engine))
            for size in cls.insert_sizes(count)
        }
        return empty, segment, inserts

    def insert(self, rows: list[Row]) -> None:
        free = [slot for slot in range(self.count) if slot not in self.live]
        size = next(n for n in sorted(self._inserts) if n >= len(rows))
        where = np.full((size,), self.count, np.int32)  # past the last slot: dropped
        where[: len(rows)] = free[: len(rows)]
        tokens = padded([row.ids for row in rows], size, self.bucket)
        keys = (
            row_keys(rows, size)
            if self.request.settings.samples
            else np.zeros((size, 2), np.uint32)
        )
        put = self.engine._put
        self.state = self._inserts[size](
            self.engine.params,
            self.state,
            put(tokens, batch=False),
            put(where, batch=False),
            put(keys, batch=False),
        )
        self.live.update(zip(free, rows, strict=False))

    def warm_up(self) -> None:
        """Runs each program once without changing a slot: insertions of padding only, and a
        segment of no steps."""
        for size, insert in self._inserts.items():
            where = np.full((size,), self.count, np.int32)  # every row dropped
            arrays = (
                np.zeros((size, self.bucket), np.int32),
                where,
                np.zeros((size, 2), np.uint32),
            )
            put = self.engine._put
            self.state = insert(
                self.engine.params, self.state, *(put(a, batch=False) for a in arrays)
            )
        self.run(free_wanted=0, max_steps=0)

    def resize(self, count: int) -> None:
        """Moves the live rows into a batch of `count` slots (a smaller or larger one)."""
        if count == self.count:
            return
        index = np.full((count,), self.count, np.int32)  # past the last slot: a free slot
        index[: len(self.live)] = list(self.live)
        resized = self.engine._program(
            "resize", self.request, (self.count, self.bucket, count), _build_resize(self.engine)
        )
        self.state = resized(self.engine.params, self.state, self.engine._put(index, batch=False))
        self.live = dict(enumerate(self.live.values()))
        self.count = count
        self._empty, self._segment, self._inserts = self.compile(
            self.engine, self.request, count=count, bucket=self.bucket
        )

    def run(self, *, free_wanted: int, max_steps: int) -> list[Decoded]:
        """Decodes until `free_wanted` slots are free (or `max_steps`); the rows that finished."""
        put = self.engine._put
        self.state, done, out = self._segment(
            self.engine.params,
            self.state,
            put(np.int32(min(free_wanted, self.count)), batch=False),
            put(np.int32(max_steps), batch=False),
        )
        done, out = np.asarray(done), np.asarray(out)
        finished = [slot for slot in self.live if done[slot]]
        return [Decoded(self.live.pop(slot), out[slot]) for slot in finished]


# Builders of _SlotBatch's programs. The slot state keeps the shardings the network's activation
# rules give it (None: unconstrained) and is donated: each program updates it in place.


def _build_empty(engine: Engine):
    network = engine.network

    def build(request: Request, count: int, bucket: int):
        def empty(params):
            return decoding.empty_slots(network.module, params, count, bucket, request.max_length)

        return engine._jit(empty, (), out_shardings=None)

    return build


def _build_insert(engine: Engine):
    network = engine.network

    def build(request: Request, count: int, bucket: int, size: int):
        def insert(params, slots, tokens, where, keys):
            return decoding.insert_rows(network.module, params, slots, tokens, where, keys)

        replicated = engine._partitioner.replicated()
        return engine._jit(
            insert,
            (None, replicated, replicated, replicated),
            out_shardings=None,
            donate_argnums=(1,),
        )

    return build


def _build_resize(engine: Engine):
    def build(request: Request, count: int, bucket: int, new_count: int):
        def resize(params, slots, index):
            del params
            return decoding.gather_slots(slots, index)

        replicated = engine._partitioner.replicated()
        # Not donated: the resized state has other shapes, so it cannot reuse the old buffers.
        return engine._jit(resize, (None, replicated), out_shardings=None)

    return build


def _build_segment(engine: Engine):
    network = engine.network

    def build(request: Request, count: int, bucket: int):
        settings = request.settings
        picking = decoding.Picking(network.vocabulary.eos_id, settings.temperature, settings.top_k)

        def segment(params, slots, free_wanted, max_steps):
            slots = decoding.run_segment(
                network.module, params, slots, picking, free_wanted, max_steps
            )
            return slots, slots.done, slots.out

        replicated = engine._partitioner.replicated()
        return engine._jit(
            segment,
            (None, replicated, replicated),
            out_shardings=(None, replicated, replicated),
            donate_argnums=(1,),
        )

    return build
