"""What the decoding engine's programs run (model/engine.py, model/slot_batch.py): the key/value
cache, one decoding step, and each in a compiled `lax.while_loop`.

The encoder runs once per row; a first decoder call with decode=True creates the cache
(self-attention keys/values zeroed, cross-attention keys/values projected from the encoder output
once). Continuous decoding keeps a batch of slots (`Slots`): `insert_rows` starts rows in free
slots, `run_segment` feeds each live slot its last token at its own position and picks the next
(greedy or sampling) until enough slots are free. `beam_search` extends every live hypothesis of
a batch by one token per step until no hypothesis can improve.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5tpu.model import feature_major, precision
from t5tpu.model.decoding_settings import DecodingSettings
from t5tpu.model.layers import CACHE_AXES

Array = jax.Array


def first_max_index(x: Array, axis: int = -1) -> Array:
    """jnp.argmax over `axis` (the first index of the largest value), as two plain
    reductions: XLA:CPU runs argmax's (value, index) reduction unvectorized, far slower than
    these two over a row of logits (docs/PERFORMANCE.md). A NaN row gives the axis length
    instead of NaN's index."""
    axis = axis % x.ndim
    largest = jnp.max(x, axis=axis, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return jnp.min(jnp.where(x == largest, index, x.shape[axis]), axis=axis)


class RowSettings(NamedTuple):
    """Each slot's own values: arrays, so rows of any values share one compiled program."""

    temperature: Array  # [rows] float32; 0: greedy
    top_k: Array  # [rows] int32; 0: no limit
    top_p: Array  # [rows] float32; 1.0: no limit
    repetition_penalty: Array  # [rows] float32; 1.0: none
    no_repeat_ngram_size: Array  # [rows] int32; 0: off
    min_new_tokens: Array  # [rows] int32
    max_new_tokens: Array  # [rows] int32: the row ends at this many tokens


ROW_DTYPES = RowSettings(np.float32, np.int32, np.float32, np.float32, np.int32, np.int32, np.int32)


def row_settings(settings: DecodingSettings, rows: int, max_length: int) -> RowSettings:
    """`rows` slots' values for `settings` in programs of `max_length` tokens (host arrays; a
    free slot's are harmless ones)."""
    own_length = settings.max_new_tokens
    values = RowSettings(
        temperature=settings.temperature if settings.samples else 0.0,
        top_k=settings.top_k,
        top_p=settings.top_p,
        repetition_penalty=settings.repetition_penalty,
        no_repeat_ngram_size=settings.no_repeat_ngram_size,
        min_new_tokens=settings.min_new_tokens,
        max_new_tokens=max_length if own_length is None else min(own_length, max_length),
    )
    return RowSettings(
        *(np.full((rows,), v, dtype) for v, dtype in zip(values, ROW_DTYPES, strict=True))
    )


def sampled_logits(logits: Array, sampling: RowSettings) -> Array:
    """[rows, vocab] logits as sampling draws from them, each row with its own values, in
    Hugging Face's order and by its rules (TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper): divided by the temperature; below the k-th largest dropped (ties kept);
    then, in ascending order, those whose cumulative probability is at most 1 - top_p dropped,
    the most likely always kept. Dropped: -inf. The sorts are skipped when no row limits."""
    # A greedy row's temperature is 0: it divides by 1 here and draws nothing (_pick_next).
    scaled = logits / jnp.where(sampling.temperature > 0, sampling.temperature, 1.0)[:, None]
    vocab = logits.shape[-1]

    def limited(scaled):
        ascending = jnp.sort(scaled, axis=-1)
        k = jnp.where(sampling.top_k > 0, jnp.minimum(sampling.top_k, vocab), vocab)
        kth = jnp.take_along_axis(ascending, (vocab - k)[:, None], axis=-1)
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
        order = jnp.argsort(scaled, axis=-1)
        probabilities = jax.nn.softmax(jnp.take_along_axis(scaled, order, axis=-1), axis=-1)
        drop = jnp.cumsum(probabilities, axis=-1) <= (1 - sampling.top_p)[:, None]
        drop = drop.at[:, -1].set(False)
        rows = jnp.arange(scaled.shape[0])[:, None]
        dropped = jnp.zeros_like(drop).at[rows, order].set(drop)
        return jnp.where(dropped, -jnp.inf, scaled)

    limits = jnp.any(sampling.top_k > 0) | jnp.any(sampling.top_p < 1)
    return jax.lax.cond(limits, limited, lambda scaled: scaled, scaled)


class Prefix(NamedTuple):
    """What each row decoded so far, as the penalties read it."""

    out: Array  # [rows, max_length] the tokens so far, zeros after
    position: Array  # [rows] how many there are
    live: Array  # [rows] still decoding (the others' penalties are not worked out)


def penalized_logits(logits: Array, values: RowSettings, prefix: Prefix, eos_id: int) -> Array:
    """[rows, vocab] logits after Hugging Face's RepetitionPenaltyLogitsProcessor,
    NoRepeatNGramLogitsProcessor and MinNewTokensLengthLogitsProcessor, in that order, each row
    with its own values. As in transformers' encoder-decoder generate, a row's decoder inputs
    so far are the start token 0 and its tokens: 0 counts as seen."""
    rows, vocab = logits.shape
    index = jnp.arange(rows)[:, None]
    seen = jnp.zeros((rows, vocab), jnp.bool_).at[index, prefix.out].set(True)
    penalty = values.repetition_penalty[:, None]
    repeated = jnp.where(logits < 0, logits * penalty, logits / penalty)
    logits = jnp.where(seen & (penalty != 1), repeated, logits)
    banned = _repeated_ngram_ends(prefix, values.no_repeat_ngram_size, vocab)
    logits = jnp.where(banned, -jnp.inf, logits)
    too_short = (prefix.position < values.min_new_tokens)[:, None]
    return jnp.where(too_short & (jnp.arange(vocab) == eos_id), -jnp.inf, logits)


def _repeated_ngram_ends(prefix: Prefix, sizes: Array, vocab: int) -> Array:
    """[rows, vocab] the tokens that would repeat an n-gram of the row's decoder inputs so far
    (n: its `sizes`; 0: none): those that followed an earlier occurrence of its last n - 1."""
    rows, max_length = prefix.out.shape
    tokens = jnp.pad(prefix.out, ((0, 0), (1, 0)))  # the start token 0 first
    length = (prefix.position + 1)[:, None]  # decoder inputs so far
    n = sizes[:, None]
    starts = jnp.arange(max_length + 1)[None, :]

    def at(columns):
        return jnp.take_along_axis(tokens, jnp.clip(columns, 0, max_length), axis=1)

    def same(i, match):  # the n-gram at each start agrees with the last n - 1 tokens at i
        agrees = at(starts + i) == at(length - n + 1 + i)
        return match & (agrees | (i >= n - 1))

    match = jax.lax.fori_loop(0, jnp.max(sizes) - 1, same, jnp.ones_like(tokens, jnp.bool_))
    match &= (n > 0) & (starts <= length - n)
    index = jnp.arange(rows)[:, None]
    return jnp.zeros((rows, vocab), jnp.bool_).at[index, at(starts + n - 1)].max(match)


def _pick_next(logits: Array, rng: Array, picking, values: RowSettings, prefix: Prefix) -> Array:
    """Each row's next token: the most likely where its temperature is 0, else a draw from its
    sampled_logits with its own key ([rows, 2]: a row's draw is independent of its batch
    mates), after the penalties of the rows that have any. Which of these any live row needs
    is found at run time, so one program decodes greedy and sampling rows together, and a
    batch of plain greedy rows reads its logits as they come. `picking.vocab_axis` 0: logits
    come as [vocab, rows] (the feature-major step's)."""
    live = prefix.live
    samples = jnp.any(live & (values.temperature > 0))
    penalizes = live & (
        (values.repetition_penalty != 1)
        | (values.no_repeat_ngram_size > 0)
        | (prefix.position < values.min_new_tokens)
    )

    def rows_first(logits):
        if picking.vocab_axis == 0:
            # The barrier keeps XLA from folding the transpose into the logits' dot.
            return jax.lax.optimization_barrier(logits).T
        return logits

    def pick(logits):  # [rows, vocab]
        greedy = first_max_index(logits)

        def drawn(logits):
            filtered = sampled_logits(logits, values)
            drawn = jax.vmap(jax.random.categorical)(rng, filtered).astype(jnp.int32)
            return jnp.where(values.temperature > 0, drawn, greedy)

        return jax.lax.cond(samples, drawn, lambda _: greedy, logits)

    def plain(logits):
        def greedy(logits):  # no transpose: greedy reads either layout
            return first_max_index(logits, picking.vocab_axis)

        return jax.lax.cond(samples, lambda logits: pick(rows_first(logits)), greedy, logits)

    def penalized(logits):
        return pick(penalized_logits(rows_first(logits), values, prefix, picking.eos_id))

    return jax.lax.cond(jnp.any(penalizes), penalized, plain, logits)


def _encode_and_make_cache(module, params, encoder_input_tokens: Array, max_decode_length: int):
    """Runs the encoder once and creates the decoder cache for `max_decode_length` positions."""
    encoded = module.apply({"params": params}, encoder_input_tokens, method="encode")
    return encoded, _make_cache(module, params, encoded, encoder_input_tokens, max_decode_length)


def _make_cache(module, params, encoded, encoder_input_tokens, max_decode_length: int):
    """The decoder cache for `max_decode_length` positions over `encoded`."""
    _, fresh = module.apply(
        {"params": params},
        encoded,
        encoder_input_tokens,
        jnp.zeros((encoded.shape[0], max_decode_length), jnp.int32),
        decode=True,
        mutable=["cache"],
        method="decode",
    )
    return fresh["cache"]


def _decoder_step(module, params, cache, encoded, encoder_input_tokens, token, position):
    """Feeds one token per row at `position`: (float32 logits [rows, vocab], updated cache)."""
    logits, updated = module.apply(
        {"params": params, "cache": cache},
        encoded,
        encoder_input_tokens,
        token[:, None],
        decode=True,
        decode_position=position,
        mutable=["cache"],
        method="decode",
    )
    return logits[:, 0], updated["cache"]


def row_keys(seed: int, indices) -> np.ndarray:
    """A sampling key for each example, from its index among the inputs ([len(indices), 2]):
    an example's draw then depends on the seed and its place, never on its batch mates, so
    infer's chunks, the Python API's calls and a server's batches sample alike."""
    return keys_of(np.full(len(indices), seed), indices)


@jax.jit
def _keys_of(seeds: Array, indices: Array) -> Array:
    return jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.PRNGKey(seed), i))(seeds, indices)


def keys_of(seeds, indices) -> np.ndarray:
    """row_keys of rows of their own seeds ([n, 2]), in one compiled call per n."""
    return np.asarray(_keys_of(np.asarray(seeds, np.int32), np.asarray(indices, np.uint32)))


def _split(rng: Array) -> tuple[Array, Array]:
    """The next key(s) and this step's: of one key, or of each row's key ([batch, 2])."""
    if rng.ndim == 2:
        keys = jax.vmap(jax.random.split)(rng)
        return keys[:, 0], keys[:, 1]
    return tuple(jax.random.split(rng))


class Slots(NamedTuple):
    """Continuous decoding's state: a fixed number of rows ("slots"), each decoding one input at
    its own position or free. Rows that finish are read out and their slots refilled with new
    inputs (`insert_rows`) while the others go on (`run_segment`), so a batch never waits for
    its longest row with its other slots idle."""

    cache: Any  # the decoder's attention caches, one row per slot
    encoder_tokens: Array  # [slots, input length]: the cross-attention mask reads them
    token: Array  # [slots] the last token fed
    position: Array  # [slots] the position each slot decodes next
    out: Array  # [slots, max_length] tokens so far, zeros after
    done: Array  # [slots] finished (by EOS or length) or free
    keys: Array  # [slots, 2] each slot's sampling key (unused when greedy)
    values: RowSettings  # each slot's own temperature, top_k, top_p and penalties


def slot_shapes(module, params, rows: int, input_length: int, max_length: int) -> Slots:
    """The shapes and dtypes of `rows` slots for inputs padded to `input_length` and outputs of
    up to `max_length` (nothing is computed; `params` may be shapes alone)."""

    def empty(params):
        tokens = jnp.zeros((rows, input_length), jnp.int32)
        # The encoder output's shape is known: tracing the encoder too would double the cost.
        encoded = jnp.zeros(
            (rows, input_length, module.config.emb_dim), module.config.activation_dtype
        )
        return Slots(
            cache=_make_cache(module, params, encoded, tokens, max_length),
            encoder_tokens=tokens,
            token=jnp.zeros((rows,), jnp.int32),
            position=jnp.zeros((rows,), jnp.int32),
            out=jnp.zeros((rows, max_length), jnp.int32),
            done=jnp.ones((rows,), jnp.bool_),
            keys=jnp.zeros((rows, 2), jnp.uint32),
            values=RowSettings(
                *map(jnp.asarray, row_settings(DecodingSettings(), rows, max_length))
            ),
        )

    return jax.eval_shape(empty, params)


def slot_axes(shapes: Slots) -> Slots:
    """Each leaf's logical axis names (partitioning.py's rules map them to the mesh): caches
    head-major as the attention layers write them, everything else by row."""

    def cache_axes(path, leaf):
        axes = ("length",) if _path_names(path)[-1] == "max_length" else CACHE_AXES
        return ("layers",) * (leaf.ndim - len(axes)) + axes

    return Slots(
        cache=jax.tree_util.tree_map_with_path(cache_axes, shapes.cache),
        encoder_tokens=("batch", "length"),
        token=("batch",),
        position=("batch",),
        out=("batch", "length"),
        done=("batch",),
        keys=("batch", None),
        values=RowSettings(*[("batch",)] * len(RowSettings._fields)),
    )


def insert_rows(
    module, params, slots: Slots, tokens: Array, where: Array, keys: Array, values: RowSettings
) -> Slots:
    """Starts decoding `tokens` ([n, input length]) in slots `where` ([n]): their encoder runs
    and their caches are written over the slots' (an index past the last slot drops its row, so
    a short group can be padded to a compiled size). keys: [n, 2] the rows' sampling keys;
    values: their settings ([n] each)."""
    max_length = slots.out.shape[1]
    _, fresh = _encode_and_make_cache(module, params, tokens, max_length)

    def put(path, old, new):
        # The length marker has no rows. A slot's old self-attention keys and values are left:
        # a row reads only the positions it has written itself (the rest are masked).
        if _path_names(path)[-1] == "max_length" or _is_self_attention_cache(path):
            return old
        index = (slice(None),) * _batch_axis(path) + (where,)
        write = lambda cache, rows: cache.at[index].set(rows, mode="drop")
        return precision.on_bits(write, old, new.astype(old.dtype))

    def rows(old, new):
        return old.at[where].set(new, mode="drop")

    zeros = jnp.zeros_like(where)
    return Slots(
        cache=jax.tree_util.tree_map_with_path(put, slots.cache, fresh),
        encoder_tokens=rows(slots.encoder_tokens, tokens),
        token=rows(slots.token, zeros),
        position=rows(slots.position, zeros),
        out=rows(slots.out, jnp.zeros((len(where), max_length), jnp.int32)),
        done=rows(slots.done, zeros.astype(jnp.bool_)),
        keys=rows(slots.keys, keys),
        values=RowSettings(*map(rows, slots.values, values)),
    )


@dataclasses.dataclass(frozen=True)
class Picking:
    """What `run_segment` picks tokens by besides each slot's own values (greedy or sampling,
    in the slots, not in the program): the token that ends a row, and the vocabulary's axis in
    the step's logits."""

    eos_id: int
    vocab_axis: int = -1


def run_segment(
    module, params, slots: Slots, picking: Picking, free_wanted, max_steps, weights=None
) -> Slots:
    """Decodes every unfinished slot one token per step, until at least `free_wanted` slots are
    finished or free, every slot is, or `max_steps` steps ran. Each slot feeds its own last token
    at its own position and draws from its own key, split once per step as `decode` splits it,
    so a row decodes exactly as it would have in a batch of its own. `weights`: the
    feature-major step's (feature_major.held), or None for the network's decode."""
    rows, max_length = slots.out.shape
    decoder_step, vocab_axis = _segment_step(module, params, weights, rows)
    picking = dataclasses.replace(picking, vocab_axis=vocab_axis)
    columns = jnp.arange(max_length)[None, :]

    def step(carry):
        s, steps = carry
        logits, cache = decoder_step(s.cache, s.encoder_tokens, s.token, s.position)
        keys, step_keys = _split(s.keys)
        prefix = Prefix(s.out, s.position, ~s.done)
        token = _pick_next(logits, step_keys, picking, s.values, prefix)
        token = jnp.where(s.done, 0, token)
        written = (columns == s.position[:, None]) & ~s.done[:, None]
        out = jnp.where(written, token[:, None], s.out)
        position = jnp.where(s.done, s.position, s.position + 1)
        done = s.done | (token == picking.eos_id) | (position >= s.values.max_new_tokens)
        advanced = Slots(cache, s.encoder_tokens, token, position, out, done, keys, s.values)
        return advanced, steps + 1

    def going(carry):
        s, steps = carry
        finished = jnp.sum(s.done)
        return (finished < free_wanted) & (finished < rows) & (steps < max_steps)

    return jax.lax.while_loop(going, step, (slots, jnp.int32(0)))[0]


def _segment_step(module, params, weights, rows: int):
    """A segment's decoding step, `(cache, encoder_tokens, token, position) -> (float32 logits,
    cache)`, and its logits' vocabulary axis: the feature-major step's ([vocab, rows]) where
    the engine holds its weights (model/feature_major.py), else the network's decode's."""
    config = module.config
    if weights is not None:

        def fast(cache, encoder_tokens, token, position):
            return feature_major.step(config, weights, cache, encoder_tokens, token, position)

        return fast, 0
    # Cross-attention reads its cached keys and values; the encoder output is not used again.
    encoded = jnp.zeros((rows, 1, config.emb_dim), config.activation_dtype)

    def network(cache, encoder_tokens, token, position):
        return _decoder_step(module, params, cache, encoded, encoder_tokens, token, position)

    return network, -1


def length_penalty(length: Array | int, alpha: float) -> Array:
    """T5X's (GNMT's) length normalization: ((5 + length) / 6) ** alpha; 1 when alpha is 0."""
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


class Normalization(NamedTuple):
    """How beam search ranks finished hypotheses of other lengths, each example its own: T5X's
    length_penalty(length, alpha), or where `hf` Hugging Face's length ** exponent (its
    `length_penalty`) with its stopping rule (early_stopping=False: an example stops taking
    hypotheses once its best live one, normalized at its length so far, cannot beat its worst
    finished one). Arrays [batch]."""

    alpha: Array
    exponent: Array
    hf: Array

    @classmethod
    def of(cls, batch: int, alpha=0.6, exponent=None) -> Normalization:
        """T5X's alpha for every example (`exponent` None), else Hugging Face's exponent."""
        hf = exponent is not None
        values = (alpha, 1.0 if exponent is None else exponent, hf)
        return cls(*(jnp.broadcast_to(jnp.asarray(v), (batch,)) for v in values))

    def penalty(self, length: Array | int) -> Array:
        """The divisor of a hypothesis of `length` tokens (EOS included): [batch, ...] for
        `length` [batch, ...] (or one length)."""
        length = jnp.asarray(length, jnp.float32)
        per_row = [x.reshape(x.shape + (1,) * max(length.ndim - 1, 0)) for x in self]
        alpha, exponent, hf = per_row
        return jnp.where(hf, length**exponent, length_penalty(length, alpha.astype(jnp.float32)))


def _path_names(path) -> list:
    return [getattr(key, "key", None) for key in path]


def _is_self_attention_cache(path) -> bool:
    """Self-attention keys/values differ per hypothesis and follow their beam when beams are
    reordered; cross-attention keys/values are the same for every beam of an example, and
    `max_length` has no batch dimension."""
    names = _path_names(path)
    return "self_attention" in names and names[-1] in ("cached_key", "cached_value")


def _batch_axis(path) -> int:
    """Caches of scanned layers (under "layers", not layers_N) lead with the layer axis."""
    return 1 if "layers" in _path_names(path) else 0


def _reorder_beams(cache, parent: Array):
    """Each hypothesis takes over its parent's self-attention cache. parent: [batch, beams]."""
    batch, beams = parent.shape

    def gather(path, leaf):
        if not _is_self_attention_cache(path):
            return leaf
        axis = _batch_axis(path)
        shape = leaf.shape
        per_beam = leaf.reshape(shape[:axis] + (batch, beams) + shape[axis + 1 :])
        index = parent.reshape((1,) * axis + (batch, beams) + (1,) * (leaf.ndim - axis - 1))
        return jnp.take_along_axis(per_beam, index, axis=axis + 1).reshape(shape)

    return jax.tree_util.tree_map_with_path(gather, cache)


def _expand_to_beams(tree, num_beams: int, only):
    """Repeats each example's rows `num_beams` times (example-major: row = example * beams + k)
    in the leaves whose path `only` accepts."""

    def expand(path, leaf):
        return jnp.repeat(leaf, num_beams, axis=_batch_axis(path)) if only(path) else leaf

    return jax.tree_util.tree_map_with_path(expand, tree)


def _top_hypotheses(scores: Array, tokens: Array, k: int) -> tuple[Array, Array]:
    """The k best (scores [batch, n], tokens [batch, n, length]) per example, best first."""
    best, index = jax.lax.top_k(scores, k)
    return best, jnp.take_along_axis(tokens, index[:, :, None], axis=1)


class _Beams(NamedTuple):
    """Beam search's loop state: per example, `num_beams` live and finished hypotheses."""

    position: Array  # the position being decoded
    cache: Any  # the decoder's attention caches (self-attention rows per hypothesis)
    token: Array  # [batch * beams] the last token of each live hypothesis
    live: Array  # [batch, beams, max_length] the live hypotheses' tokens
    live_scores: Array  # [batch, beams] their summed log-probabilities
    finished: Array  # [batch, beams, max_length] the best finished hypotheses, best first
    finished_scores: Array  # [batch, beams] their length-normalized scores (-inf: none yet)
    open: Array  # [batch] Hugging Face's stopping rule: whether an example takes hypotheses


@dataclasses.dataclass(frozen=True)
class _BeamSearch:
    """One beam search's fixed inputs and its loop's step and stopping rule."""

    module: nn.Module
    params: Any
    encoded: Array
    encoder_tokens: Array  # the encoder's tokens, repeated per beam (for the masks)
    max_length: int  # the hypotheses' (and caches') length
    eos_id: int
    num_beams: int
    normalization: Normalization
    limit: Array  # [batch] each example's longest hypothesis, at most max_length

    def start(self, cache, batch: int) -> _Beams:
        empty = jnp.zeros((batch, self.num_beams, self.max_length), jnp.int32)
        # All beams start from the same empty prefix: only the first one is live, so the first
        # step does not produce num_beams copies of each extension.
        first_live = jnp.where(jnp.arange(self.num_beams) == 0, 0.0, -jnp.inf)
        return _Beams(
            position=jnp.int32(0),
            cache=cache,
            token=jnp.zeros((batch * self.num_beams,), jnp.int32),
            live=empty,
            live_scores=jnp.broadcast_to(first_live, (batch, self.num_beams)).astype(jnp.float32),
            finished=empty,
            finished_scores=jnp.full((batch, self.num_beams), -jnp.inf, jnp.float32),
            open=jnp.ones((batch,), bool),
        )

    def not_finished(self, beams: _Beams) -> Array:
        # Log-probabilities only fall as a hypothesis grows, so the best a live beam can still
        # reach is its score under the largest penalty of any length it may end at.
        penalty = self.normalization.penalty
        largest_penalty = jnp.maximum(penalty(beams.position + 1), penalty(self.limit))
        best_reachable = beams.live_scores[:, 0] / largest_penalty
        settled = beams.finished_scores[:, -1] >= best_reachable
        settled = jnp.where(self.normalization.hf, ~beams.open, settled)
        return (beams.position < self.max_length) & ~jnp.all(
            settled | (beams.position >= self.limit)
        )

    def step(self, beams: _Beams) -> _Beams:
        """Extends every live hypothesis by every token and keeps the best of each kind."""
        logits, cache = _decoder_step(
            self.module,
            self.params,
            beams.cache,
            self.encoded,
            self.encoder_tokens,
            beams.token,
            beams.position,
        )
        batch = beams.live.shape[0]
        log_probs = jax.nn.log_softmax(logits).reshape(batch, self.num_beams, -1)
        candidates = beams.live_scores[:, :, None] + log_probs  # [batch, beams, vocab]
        kth_best, live_scores, flat_index = self._best_extensions(candidates)
        pool = [(beams.finished_scores, beams.finished)]
        if self.eos_id >= 0:
            pool.append(self._ended_by_eos(candidates, kth_best, beams))
        vocab = candidates.shape[-1]
        parent, next_token = flat_index // vocab, (flat_index % vocab).astype(jnp.int32)
        live = jnp.take_along_axis(beams.live, parent[:, :, None], axis=1)
        live = live.at[:, :, beams.position].set(next_token)
        # At an example's last position every live hypothesis is finished by length (Hugging
        # Face's: those among the step's num_beams best extensions).
        at_end = (beams.position + 1 == self.limit)[:, None] & self._takes(beams)
        at_end &= ~self.normalization.hf[:, None] | (live_scores >= kth_best)
        final_penalty = self.normalization.penalty(self.limit)[:, None]
        pool.append((jnp.where(at_end, live_scores / final_penalty, -jnp.inf), live))
        finished_scores, finished = _top_hypotheses(
            jnp.concatenate([scores for scores, _ in pool], axis=1),
            jnp.concatenate([tokens for _, tokens in pool], axis=1),
            self.num_beams,
        )
        # Hugging Face's rule: the best live hypothesis normalized at its length so far.
        best_now = live_scores[:, 0] / self.normalization.penalty(beams.position + 1)
        improves = best_now > finished_scores[:, -1]
        return _Beams(
            open=beams.open & (improves | ~self.normalization.hf),
            position=beams.position + 1,
            cache=_reorder_beams(cache, parent),
            token=next_token.reshape(-1),
            live=live,
            live_scores=live_scores,
            finished=finished,
            finished_scores=finished_scores,
        )

    def _best_extensions(self, candidates: Array) -> tuple[Array, Array, Array]:
        """(the num_beams-th best extension's score [batch, 1], the num_beams best extensions
        other than EOS: their scores and flat indices [batch, beams]). One top-k over the whole
        [batch, beams * vocab] serves both: at most one EOS extension per beam is among the
        2 * num_beams best, so the best others are too, and a second top-k over the whole
        vocabulary is saved every step (docs/PERFORMANCE.md)."""
        batch, vocab = candidates.shape[0], candidates.shape[-1]
        top_scores, top_index = jax.lax.top_k(candidates.reshape(batch, -1), 2 * self.num_beams)
        kth_best = top_scores[:, self.num_beams - 1 : self.num_beams]
        if self.eos_id >= 0:
            top_scores = jnp.where(top_index % vocab == self.eos_id, -jnp.inf, top_scores)
        live_scores, order = jax.lax.top_k(top_scores, self.num_beams)
        return kth_best, live_scores, jnp.take_along_axis(top_index, order, axis=1)

    def _ended_by_eos(self, candidates: Array, kth_best: Array, beams: _Beams):
        """(scores, tokens) of the hypotheses EOS finishes at this step: those whose EOS
        extension ranks among the step's num_beams best extensions (at least `kth_best`, so
        one beam is exactly greedy decoding when alpha is 0); -inf for the others."""
        ending = candidates[:, :, self.eos_id]
        penalty = self.normalization.penalty(beams.position + 1)[:, None]
        kept = (ending >= kth_best) & self._takes(beams)
        scores = jnp.where(kept, ending / penalty, -jnp.inf)
        return scores, beams.live.at[:, :, beams.position].set(self.eos_id)

    def _takes(self, beams: _Beams) -> Array:
        """[batch, 1]: whether an example takes finished hypotheses at this step (not past its
        limit, nor closed by Hugging Face's stopping rule)."""
        return ((beams.position < self.limit) & beams.open)[:, None]


def beam_hypotheses(
    module: nn.Module,
    params,
    encoder_input_tokens: Array,
    max_decode_length: int,
    eos_id: int,
    num_beams: int = 4,
    alpha: float | Array | Normalization = 0.6,
    limit: Array | None = None,
) -> tuple[Array, Array]:
    """Beam search with T5X's length penalty. Returns (tokens [batch, num_beams,
    max_decode_length], scores [batch, num_beams]): each example's num_beams best hypotheses,
    best first, each ending at its EOS (included), zeros after. `alpha` (T5X's, or a
    Normalization) and `limit` (each example's longest hypothesis; None: max_decode_length)
    are values, one or one per example: a program of one width and length decodes examples of
    any.

    A hypothesis is finished when it emits EOS or reaches its limit; its score is its
    summed log-probability divided by length_penalty(its length in tokens, EOS included). Every
    step extends the `num_beams` live hypotheses by every token; EOS extensions that rank among
    the step's `num_beams` best extensions join the kept `num_beams` best finished hypotheses, and
    the `num_beams` best other extensions become the next live ones. The loop stops early once no
    live hypothesis can still beat an example's worst kept finished one.
    `eos_id < 0` means no token ends a hypothesis (every one runs to max_decode_length).
    """
    # The encoder and the cross-attention keys/values are computed and kept once per example:
    # the attention layers let an example's beams share them. Self-attention caches are per beam.
    encoded, cache = _encode_and_make_cache(module, params, encoder_input_tokens, max_decode_length)
    batch = encoder_input_tokens.shape[0]
    limit = max_decode_length if limit is None else jnp.minimum(limit, max_decode_length)
    search = _BeamSearch(
        module=module,
        params=params,
        encoded=encoded,
        encoder_tokens=jnp.repeat(encoder_input_tokens, num_beams, axis=0),
        max_length=max_decode_length,
        eos_id=eos_id,
        num_beams=num_beams,
        normalization=alpha if isinstance(alpha, Normalization) else Normalization.of(batch, alpha),
        limit=jnp.broadcast_to(jnp.asarray(limit, jnp.int32), (batch,)),
    )
    cache = _expand_to_beams(cache, num_beams, only=_is_self_attention_cache)
    start = search.start(cache, batch=batch)
    beams = jax.lax.while_loop(search.not_finished, search.step, start)
    return beams.finished, beams.finished_scores


def beam_search(*args, **kwargs) -> tuple[Array, Array]:
    """beam_hypotheses' best hypothesis of each example: (tokens [batch, max_decode_length],
    its score [batch])."""
    tokens, scores = beam_hypotheses(*args, **kwargs)
    return tokens[:, 0], scores[:, 0]


def log_likelihoods(
    tokens: Array,
    scores: Array,
    eos_id: int,
    alpha: float | Array | Normalization,
    limit: Array | None = None,
) -> Array:
    """The summed log-probabilities of finished hypotheses ([..., length] tokens) whose
    length-normalized `scores` beam search gave: each score times its length's penalty (one
    without EOS is as long as its `limit`, broadcast against `scores`; None: all tokens)."""
    ends = tokens == eos_id
    unended = tokens.shape[-1] if limit is None else limit
    length = jnp.where(jnp.any(ends, -1), jnp.argmax(ends, -1) + 1, unended)
    if isinstance(alpha, Normalization):
        return scores * alpha.penalty(length)
    return scores * length_penalty(length, alpha)
