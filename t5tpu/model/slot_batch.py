"""Continuous decoding on the devices: a batch of slots, its two programs, and its state kept.

A batch of `count` slots for inputs padded to `bucket` runs two compiled programs, each built
once per (settings, count, bucket):
- `insert`: encodes up to `insert_size(count)` new rows and writes their caches into free slots
  (an index past the last slot drops a padding row);
- `segment`: frees the slots it is told to (rows whose callers left), then decodes every live
  slot one token per step until enough slots are free.

Inserting a quarter of the slots at a time keeps the encoder's padding small (on a CPU the
encoder costs about as much per row in any batch) while a batch that starts full needs only four
insertions. The slot state has explicit shardings (its logical axes through the partitioner's
rules), so an empty state is made on the host without a program of its own, and a finished
batch's state is kept for the next batch of its shape: a row reads only the cache positions it
wrote itself, so nothing needs clearing.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import jax
import numpy as np

from t5tpu.model import decoding
from t5tpu.partitioning import spec_for_shape


def insert_size(count: int) -> int:
    """Rows one insertion encodes: a quarter of the slots (at least one)."""
    return max(1, count // 4)


@dataclasses.dataclass(frozen=True)
class Shape:
    """What a slot state's arrays depend on."""

    count: int
    bucket: int
    max_length: int


class StatePool:
    """One idle slot state per shape, handed to the next batch of that shape; a batch that was
    abandoned with rows in flight gives nothing back (its state is dropped). Each shape's
    abstract state (shapes, dtypes, shardings) is worked out once: tracing the network for it
    costs about as much as tracing a program."""

    def __init__(self, *, model, partitioner, param_view=None):
        self._model, self._partitioner = model, partitioner
        self._view = param_view or (lambda params: params)
        self._idle: dict[Shape, decoding.Slots] = {}
        self._abstract: dict[Shape, decoding.Slots] = {}

    def abstract(self, params, shape: Shape) -> decoding.Slots:
        """The state of `shape` as jax.ShapeDtypeStructs with their shardings."""
        if shape not in self._abstract:
            # The network reads the parameters through the engine's view (a LoRA tree unwrapped).
            viewed = jax.eval_shape(self._view, params)
            module = self._model.module
            shapes = decoding.slot_shapes(
                module, viewed, shape.count, shape.bucket, shape.max_length
            )
            rules, sizes = self._partitioner.rules, self._partitioner.mesh_sizes

            def placed(axes, leaf):
                spec = spec_for_shape(axes, leaf.shape, rules, sizes)
                sharding = self._partitioner.sharding(spec)
                return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

            self._abstract[shape] = jax.tree_util.tree_map(
                placed, decoding.slot_axes(shapes), shapes, is_leaf=_is_axes
            )
        return self._abstract[shape]

    def shardings(self, params, shape: Shape) -> decoding.Slots:
        return jax.tree_util.tree_map(lambda x: x.sharding, self.abstract(params, shape))

    def take(self, params, shape: Shape) -> decoding.Slots:
        if shape in self._idle:
            return self._idle.pop(shape)

        def empty(leaf):
            host = np.zeros(leaf.shape, leaf.dtype)
            if leaf.dtype == np.bool_:
                host[...] = True  # `done`: every slot free
            return jax.make_array_from_process_local_data(leaf.sharding, host, leaf.shape)

        return jax.tree_util.tree_map(empty, self.abstract(params, shape))

    def give_back(self, shape: Shape, state: decoding.Slots) -> None:
        self._idle[shape] = state

    def clear(self) -> None:
        self._idle.clear()


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


@dataclasses.dataclass(frozen=True)
class Segment:
    """What a segment left: (row, ids so far) of the rows that finished and of those still
    decoding."""

    finished: list
    decoding: list


@dataclasses.dataclass(frozen=True)
class Programs:
    """A slot batch's two compiled programs."""

    insert: object
    segment: object


def compile_ahead(*, engine, programs: Programs, shape: Shape, together: bool = False) -> None:
    """Compiles both programs for their arguments' shapes without running them (a later call
    finds them in jax's caches): warm-up compiles shapes in parallel this way, and a shape met
    first in a call compiles its two programs `together` (XLA compiles each on one core)."""
    params = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), engine.params
    )
    state = engine.states.abstract(engine.params, shape)
    replicated = engine.partitioner.replicated()

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    size = insert_size(shape.count)
    values = decoding.RowSettings(*(arg((size,), dtype) for dtype in decoding.ROW_DTYPES))
    rows = (
        arg((size, shape.bucket), np.int32),
        arg((size,), np.int32),
        arg((size, 2), np.uint32),
        values,
    )
    compiles = (
        lambda: programs.insert.lower(params, state, *rows).compile(),
        lambda: programs.segment.lower(
            params,
            engine.step_weights,
            state,
            arg((shape.count,), np.bool_),
            arg((), np.int32),
            arg((), np.int32),
        ).compile(),
    )
    with concurrent.futures.ThreadPoolExecutor(2 if together else 1) as pool:
        for future in [pool.submit(compile) for compile in compiles]:
            future.result()


def build_insert(*, engine, request, shape: Shape):
    """The program that starts rows in free slots (jit'd; compiled at its first call). The
    state is donated: it is updated in place."""
    module = engine.model.module
    state = engine.states.shardings(engine.params, shape)
    replicated = engine.partitioner.replicated()

    def insert(params, slots, tokens, where, keys, values):
        return decoding.insert_rows(module, params, slots, tokens, where, keys, values)

    replicated_values = decoding.RowSettings(*[replicated] * len(decoding.RowSettings._fields))
    in_shardings = (state, replicated, replicated, replicated, replicated_values)
    return engine.jit(insert, in_shardings, state, (1,))


def build_segment(*, engine, request, shape: Shape):
    """The program that decodes a batch's live slots until enough are free (jit'd)."""
    module = engine.model.module
    picking = decoding.Picking(engine.model.vocabulary.eos_id)
    state = engine.states.shardings(engine.params, shape)
    replicated = engine.partitioner.replicated()

    def segment(params, weights, slots, freed, free_wanted, max_steps):
        slots = slots._replace(done=slots.done | freed)
        slots = decoding.run_segment(
            module, params, slots, picking, free_wanted, max_steps, weights
        )
        return slots, slots.done, slots.out

    return engine.jit(
        segment,
        (replicated, state, replicated, replicated, replicated),
        (state, replicated, replicated),
        (2,),
    )


class SlotBatch:
    """One continuous batch on the devices: its slots' state, which rows (`live`, by slot) they
    hold, and its programs."""

    def __init__(self, *, engine, request, shape: Shape):
        self.engine, self.request, self.shape = engine, request, shape
        self.count = shape.count
        self.live: dict[int, object] = {}
        self._freed = np.zeros((shape.count,), np.bool_)  # slots the next segment frees
        self._programs = engine.ready_programs(request, shape)
        self._state = engine.states.take(engine.params, shape)

    def insert(self, rows: list) -> None:
        """Starts decoding `rows` in free slots, a quarter of the slots per insertion."""
        size = insert_size(self.count)
        for start in range(0, len(rows), size):
            self._insert_some(rows[start : start + size], size)

    def _insert_some(self, rows: list, size: int) -> None:
        free = [slot for slot in range(self.count) if slot not in self.live]
        where = np.full((size,), self.count, np.int32)  # past the last slot: dropped
        where[: len(rows)] = free[: len(rows)]
        tokens = padded([row.ids for row in rows], size, self.shape.bucket)
        keys = np.zeros((size, 2), np.uint32)
        if any((row.settings or self.request.settings).samples for row in rows):
            keys = row_keys(rows, size)
        put = self.engine.replicate
        values = decoding.RowSettings(*map(put, _row_values(rows, self.request, size)))
        self._state = self._programs.insert(
            self.engine.params, self._state, put(tokens), put(where), put(keys), values
        )
        self.live.update(zip(free, rows, strict=False))
        self._freed[free[: len(rows)]] = False  # a new row took the slot: nothing to free

    def run(self, *, free_wanted: int, max_steps: int) -> Segment:
        """Decodes until `free_wanted` slots are free (or `max_steps`): the rows that finished
        and those still decoding, each with its ids so far."""
        put = self.engine.replicate
        self._state, done, out = self._programs.segment(
            self.engine.params,
            self.engine.step_weights,
            self._state,
            put(self._freed),
            put(np.int32(min(free_wanted, self.count))),
            put(np.int32(max_steps)),
        )
        self._freed[:] = False
        done, out = np.asarray(done), np.asarray(out)
        finished = [slot for slot in self.live if done[slot]]
        return Segment(
            finished=[(self.live.pop(slot), out[slot]) for slot in finished],
            decoding=[(row, out[slot]) for slot, row in self.live.items()],
        )

    def free(self, rows) -> None:
        """Takes `rows` (by identity) out of their slots: the next segment frees them."""
        leaving = {id(row) for row in rows}
        for slot in [slot for slot, row in self.live.items() if id(row) in leaving]:
            del self.live[slot]
            self._freed[slot] = True

    def warm_up(self) -> None:
        """Runs both programs once without changing a slot: an insertion of padding only and a
        segment of no steps (and the sampling keys' small program)."""
        row_keys([], insert_size(self.count))
        self._insert_some([], insert_size(self.count))
        self.run(free_wanted=0, max_steps=0)

    def close(self) -> None:
        """Hands the state to the next batch of this shape, unless rows are still in flight
        (or left slots the device has not freed yet)."""
        if not self.live and not self._freed.any() and self._state is not None:
            self.engine.states.give_back(self.shape, self._state)
        self._state = None


def _row_values(rows, request, size: int) -> decoding.RowSettings:
    """[size] values: each row's own (engine.Row.settings), else the request's; the padding
    rows' the request's."""
    values = decoding.row_settings(request.settings, size, request.max_length)
    for position, row in enumerate(rows):
        if row.settings is not None:
            own = decoding.row_settings(row.settings, 1, request.max_length)
            for column, value in zip(values, own, strict=True):
                column[position] = value[0]
    return values


def padded(rows, count: int, length: int) -> np.ndarray:
    """[count, length] int32 ids, rows cut to `length` and zero-padded (0 is T5's padding id,
    which the network masks out)."""
    out = np.zeros((count, length), np.int32)
    for i, ids in enumerate(rows):
        ids = list(ids)[:length]
        out[i, : len(ids)] = ids
    return out


def row_keys(rows, size: int) -> np.ndarray:
    """[size, 2] sampling keys: each row's from its seed and index (engine.Row), padding rows'
    after them; of one shape per insertion size, so that warm-up compiles it."""
    seeds, indices = np.zeros((2, size), np.int64)
    seeds[: len(rows)] = [row.seed for row in rows]
    indices[: len(rows)] = [row.index for row in rows]
    return decoding.keys_of(seeds, indices)
