"""The model side of the server: text to ids, and batches of rows through compiled programs.

Only the batcher's worker thread calls `run_batch` (and `warm_up`); `encode` is called from the
request threads (SentencePiece is thread-safe).

A batch holds rows of one input-length bucket (the power of two `t5tpu infer` pads an input to)
and is padded to the smallest of a few row counts (powers of two up to the largest batch), so a
few programs serve every request: one per (decoding settings, rows, input length). Sampling draws
each row from its own key, `fold_in(PRNGKey(seed), index of the row in its request)`, the key
`t5tpu infer` gives the input at that index: a request decodes as `t5tpu infer` of its
instances does, whichever requests shared its batch.

Programs are compiled ahead of time and kept per settings: the server's default settings for
good, a bounded number of others by last use, so clients that vary temperature cannot grow
memory without bound.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from t5tpu.api.model import T5Model
from t5tpu.data.batches import bucket_length
from t5tpu.model import decoding
from t5tpu.partitioning import Partitioner
from t5tpu.serve.payloads import Decoding

# Settings other than the defaults whose programs are kept (each has one program per shape).
_KEPT_SETTINGS = 8
_SHORTEST_INPUT = 16


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A text's ids, cut to the length limit with EOS kept (as the tasks' preprocessing and
    `t5tpu infer` cut them), and how many tokens it had (EOS included)."""

    ids: tuple[int, ...]
    tokens: int

    @property
    def truncated(self) -> bool:
        return self.tokens > len(self.ids)


@dataclasses.dataclass(frozen=True)
class DecodeRow:
    """One instance to decode: its ids, its index in its request and its request's seed."""

    ids: tuple[int, ...]
    index: int
    seed: int


@dataclasses.dataclass(frozen=True)
class ScoreRow:
    input_ids: tuple[int, ...]
    target_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Group:
    """Rows one program runs together: 'decode' with its settings, or 'score'; and the padded
    length of their inputs. Rows batch only with their length bucket: a short input padded to a
    long one's bucket would cost as much encoder time as the long one, and on a CPU the encoder
    is often most of a request."""

    kind: str
    length: int
    decoding: Decoding | None = None

    @classmethod
    def for_decoding(cls, settings: Decoding, length: int) -> Group:
        # The seed only picks row keys: rows of every seed share a program and a batch.
        return cls("decode", length, dataclasses.replace(settings, seed=0))

    @classmethod
    def for_scoring(cls, length: int) -> Group:
        return cls("score", length)


def batch_sizes(max_batch_size: int, data_parallelism: int) -> tuple[int, ...]:
    """The row counts batches are padded to: powers of two below max_batch_size and itself, each
    rounded up to a multiple of the devices (each takes an equal share)."""
    powers = (1 << n for n in range(max_batch_size.bit_length()))
    sizes = {max_batch_size, *(size for size in powers if size < max_batch_size)}
    return tuple(sorted({-(-size // data_parallelism) * data_parallelism for size in sizes}))


def input_buckets(max_input_length: int) -> tuple[int, ...]:
    """Every padded input length `bucket_length` gives, shortest first."""
    lengths, length = {max_input_length}, _SHORTEST_INPUT
    while length < max_input_length:
        lengths.add(length)
        length *= 2
    return tuple(sorted(lengths))


def _family(settings: Decoding | None) -> tuple:
    """The programs one set of settings has, one per shape: decoding's, or scoring's."""
    return ("score",) if settings is None else ("decode", settings.program)


class _Programs:
    """Compiled programs by (family, shape): the pinned family's kept, the others' dropped
    least recently used first once more than _KEPT_SETTINGS families have programs."""

    def __init__(self, *, pinned: tuple):
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


class Engine:
    """A loaded T5Model's parameters, vocabulary and shapes, run batch by batch."""

    def __init__(
        self,
        *,
        model: T5Model,
        partitioner: Partitioner,
        max_batch_size: int,
        defaults: Decoding,
        beam_alpha: float = 0.6,
    ):
        self.vocabulary = model.vocabulary
        self.vocab_size = model.model.config.vocab_size
        self.max_input_length = model.shapes.max_input_length
        self.max_target_length = model.shapes.max_target_length
        self.batch_sizes = batch_sizes(max_batch_size, partitioner.data_parallelism)
        self.defaults = defaults
        self._network = model.model
        self._params = model.params
        self._param_shardings = jax.tree_util.tree_map(lambda x: x.sharding, model.params)
        self._partitioner = partitioner
        self._beam_alpha = beam_alpha
        self._programs = _Programs(pinned=_family(defaults))

    @property
    def program_count(self) -> int:
        return len(self._programs)

    def encode(self, text: str, limit: int) -> Encoded:
        ids = self.vocabulary.encode(text)
        eos = self.vocabulary.eos_id
        return Encoded(ids=(*ids[: limit - 1], eos), tokens=len(ids) + 1)

    def input_bucket(self, ids: tuple[int, ...]) -> int:
        """The padded length of an input (of its batch, which holds only its bucket's)."""
        return bucket_length(len(ids), self.max_input_length)

    def run_batch(self, group: Group, rows: list) -> list:
        """The batcher's `run_batch`: texts for 'decode' rows, log-likelihoods for 'score'."""
        if group.kind == "score":
            return self._score(rows)
        return self._decode(group.decoding, rows)

    def warm_up(self, *, stopping: Callable[[], bool] = lambda: False) -> int:
        """Compiles the default settings' decoding program for every padded shape a batch can
        take (until `stopping()` says otherwise); returns how many programs are ready."""
        for rows in self.batch_sizes:
            for length in input_buckets(self.max_input_length):
                if stopping():
                    return self.program_count
                self._decoder(self.defaults, rows, length)
        return self.program_count

    # --- decoding -------------------------------------------------------------------------

    def _rows_for(self, count: int) -> int:
        return next(size for size in self.batch_sizes if size >= count)

    def _decode(self, settings: Decoding, rows: list[DecodeRow]) -> list[str]:
        size = self._rows_for(len(rows))
        length = bucket_length(max(len(row.ids) for row in rows), self.max_input_length)
        tokens = _padded([row.ids for row in rows], size, length)
        keys = _row_keys(rows, size) if settings.samples else None
        program = self._decoder(settings, size, length)
        batch = self._partitioner.batch_sharding()
        placed_keys = None if keys is None else jax.device_put(keys, batch)
        out = np.asarray(program(self._params, jax.device_put(tokens, batch), placed_keys))
        return [self.vocabulary.decode(ids.tolist()) for ids in out[: len(rows)]]

    def _decoder(self, wanted: Decoding, rows: int, length: int):
        """The decoding program for `wanted`'s settings and this shape (kept per settings)."""

        def build():
            settings = decoding.DecodingSettings(
                temperature=wanted.temperature,
                top_k=wanted.top_k,
                num_beams=wanted.num_beams,
                beam_alpha=self._beam_alpha,
            )
            network, max_length = self._network, wanted.max_length

            def decode(params, tokens, keys):
                batch = {"encoder_input_tokens": tokens}
                return network.predict(params, batch, max_length, keys, settings)

            keys = jax.ShapeDtypeStruct((rows, 2), jnp.uint32) if settings.samples else None
            return self._compile(decode, _ids_shape(rows, length), keys)

        return self._programs.get(_family(wanted), (rows, length), build)

    # --- scoring --------------------------------------------------------------------------

    def _score(self, rows: list[ScoreRow]) -> list[float]:
        size = self._rows_for(len(rows))
        length = bucket_length(max(len(row.input_ids) for row in rows), self.max_input_length)
        target_length = bucket_length(
            max(len(row.target_ids) for row in rows), self.max_target_length
        )
        inputs = _padded([row.input_ids for row in rows], size, length)
        targets = _padded([row.target_ids for row in rows], size, target_length)
        decoder_inputs = np.pad(targets, ((0, 0), (1, 0)))[:, :-1]  # shifted right
        shape = (size, length, target_length)
        program = self._programs.get(_family(None), shape, lambda: self._scorer(*shape))
        batch = self._partitioner.batch_sharding()
        placed = [jax.device_put(array, batch) for array in (inputs, decoder_inputs, targets)]
        scores = np.asarray(program(self._params, *placed))
        return [float(score) for score in scores[: len(rows)]]

    def _scorer(self, rows: int, length: int, target_length: int):
        network = self._network

        def score(params, inputs, decoder_inputs, targets):
            batch = {
                "encoder_input_tokens": inputs,
                "decoder_input_tokens": decoder_inputs,
                "decoder_target_tokens": targets,
            }
            return network.score(params, batch)

        targets = _ids_shape(rows, target_length)
        return self._compile(score, _ids_shape(rows, length), targets, targets)

    def _compile(self, fn, *shapes):
        batch = self._partitioner.batch_sharding()
        jitted = self._partitioner.jit(
            fn,
            in_shardings=(self._param_shardings, *[batch] * len(shapes)),
            out_shardings=self._partitioner.replicated(),
        )
        return jitted.lower(self._params, *shapes).compile()


def _ids_shape(rows: int, length: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((rows, length), jnp.int32)


def _padded(rows: list[tuple[int, ...]], size: int, length: int) -> np.ndarray:
    """[size, length] int32 ids, zero-padded (0 is T5's padding id, which the network masks)."""
    out = np.zeros((size, length), np.int32)
    for i, ids in enumerate(rows):
        out[i, : len(ids)] = ids
    return out


def _row_keys(rows: list[DecodeRow], size: int) -> np.ndarray:
    """[size, 2] keys: each row's from its request's seed and its index there (padding rows get
    zeros, and their samples are dropped)."""
    keys = np.zeros((size, 2), np.uint32)
    by_seed = collections.defaultdict(list)
    for position, row in enumerate(rows):
        by_seed[row.seed].append(position)
    for seed, positions in by_seed.items():
        keys[positions] = decoding.row_keys(seed, [rows[p].index for p in positions])
    return keys
