"""T5Model: a loaded T5 to call from Python — text in and out, ids in and out, scores.

Every call pads its batch to `batch_size` rows and its lengths up to a power of two (at least
16, at most the limits given to `t5tpu.load`), so calls of similar sizes reuse one compiled
program. A call compiles at most once per new (kind of call, input length bucket, output length,
decoding settings); a notebook that keeps calling `predict` with the same settings compiles a
handful of times, not once per call.

The model is task-agnostic: asking a Quora- or SQuAD-trained model in its task's own words is
done by the tasks (`t5tpu.tasks.quora.is_duplicate(model, ...)`, `t5tpu.tasks.squad.answer`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from t5tpu.errors import UserError
from t5tpu.model import decoding
from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.partitioning import Partitioner

_SHORTEST_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The compiled shapes: rows per call, and the longest input and output."""

    batch_size: int
    max_input_length: int
    max_target_length: int

    @classmethod
    def for_devices(cls, *, batch_size, max_input_length, max_target_length, data_parallelism):
        for name, value in (
            ("batch_size", batch_size),
            ("max_input_length", max_input_length),
            ("max_target_length", max_target_length),
        ):
            _check_count(name, value)
        # Each device takes an equal share of the rows.
        rows = -(-batch_size // data_parallelism) * data_parallelism
        return cls(rows, max_input_length, max_target_length)

    def bucket(self, length: int, limit: int) -> int:
        """The padded length for `length` tokens: the next power of two, within the limit."""
        padded = max(_SHORTEST_BUCKET, 1 << max(length - 1, 0).bit_length())
        return min(padded, limit)


def _check_count(name: str, value) -> None:
    """Refuses anything but a whole number >= 1 (True is an int to Python, not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{name}={value!r} must be a whole number >= 1")


def _padded(rows: list[list[int]], length: int, batch_size: int) -> np.ndarray:
    """[batch_size, length] int32 ids, rows truncated to `length` and zero-padded (0 is T5's
    padding id, which the network masks out)."""
    out = np.zeros((batch_size, length), np.int32)
    for i, ids in enumerate(rows):
        ids = list(ids)[:length]
        out[i, : len(ids)] = ids
    return out


def _ids_rows(ids) -> list[list[int]]:
    """Rows of ids from a 2-D array (zeros as padding) or a list of lists."""
    if isinstance(ids, np.ndarray) or hasattr(ids, "shape"):
        array = np.asarray(ids)
        if array.ndim != 2:
            raise UserError(f"ids must be 2-D [batch, length], got shape {array.shape}")
        return [row.tolist() for row in array]
    return [list(row) for row in ids]


class T5Model:
    """A T5 with its parameters on the devices (see `t5tpu.load`)."""

    def __init__(
        self,
        *,
        model: EncoderDecoderModel,
        params,
        param_shardings,
        partitioner: Partitioner,
        shapes: Shapes,
        has_vocabulary: bool,
        source: str,
    ):
        self.model = model
        self.params = params
        self.shapes = shapes
        self.source = source
        self._has_vocabulary = has_vocabulary
        self._partitioner = partitioner
        self._param_shardings = param_shardings
        self._programs: dict[tuple, object] = {}

    def __repr__(self) -> str:
        count = sum(x.size for x in jax.tree_util.tree_leaves(self.params))
        return f"T5Model({self.source!r}, {count:,} parameters)"

    @property
    def vocabulary(self):
        if not self._has_vocabulary:
            raise UserError(
                f"{self.source} does not say which vocabulary it uses, so text cannot be "
                "encoded: load it with gin_files=[its model gin file], or use the *_ids methods"
            )
        return self.model.vocabulary

    # --- ids in, ids or floats out ---------------------------------------------------------

    def generate_ids(
        self,
        input_ids,
        *,
        max_new_tokens: int | None = None,
        num_beams: int = 1,
        temperature: float = 0.0,
        top_k: int = 0,
        seed: int = 0,
    ) -> np.ndarray:
        """[len(input_ids), max_new_tokens] decoded ids, each row ending at EOS then zeros.

        input_ids: rows of token ids (a 2-D array with 0 as padding, or lists), ending with EOS
        as a tokenizer writes them. num_beams > 1 is beam search (length penalty 0.6);
        temperature > 0 samples (from the top_k most likely tokens when top_k > 0), seeded.
        """
        settings = self._settings(max_new_tokens, num_beams, temperature, top_k, seed)
        rows = _ids_rows(input_ids)
        return self._generate(rows, range(len(rows)), settings)

    def _settings(self, max_new_tokens, num_beams, temperature, top_k, seed) -> _Settings:
        max_new_tokens = self.shapes.max_target_length if max_new_tokens is None else max_new_tokens
        _check_count("max_length", max_new_tokens)
        settings = decoding.DecodingSettings(
            temperature=temperature, top_k=top_k, num_beams=num_beams, seed=seed
        )
        settings.check(self.model.config.vocab_size)
        return _Settings(max_new_tokens, settings)

    def _generate(self, rows: list, indices, settings: _Settings) -> np.ndarray:
        """Decoded ids of `rows`; `indices` are their places among all the inputs, which seed
        each row's sampling (decoding.row_keys), so a row samples alike in any batch."""
        decode = self._decoder(settings.max_length, settings.decoding)
        indices = list(indices)
        outputs = []
        for start in range(0, len(rows), self.shapes.batch_size):
            chunk = rows[start : start + self.shapes.batch_size]
            places = np.zeros(self.shapes.batch_size, np.int64)
            places[: len(chunk)] = indices[start : start + len(chunk)]
            keys = decoding.row_keys(settings.decoding.seed, places)
            tokens = self._input_tokens(chunk)
            outputs.append(np.asarray(decode(self.params, tokens, keys))[: len(chunk)])
        if not outputs:
            return np.zeros((0, settings.max_length), np.int32)
        return np.concatenate(outputs)

    def logits(self, input_ids, decoder_input_ids, attention_mask=None) -> np.ndarray:
        """float32 [batch, decoder length, vocab] logits, as transformers' T5 returns them.

        decoder_input_ids start with the decoder start id (0) and are the targets shifted
        right; attention_mask (1 keep, 0 padding) marks input padding, which T5 also reads from
        the 0 ids themselves. Shapes are kept as given (one compilation per new shape).
        """
        inputs = np.asarray(input_ids, np.int32)
        if attention_mask is not None:
            inputs = np.where(np.asarray(attention_mask) > 0, inputs, 0).astype(np.int32)
        decoder_inputs = np.asarray(decoder_input_ids, np.int32)
        if inputs.ndim != 2 or decoder_inputs.ndim != 2 or len(inputs) != len(decoder_inputs):
            raise UserError(
                f"input_ids {inputs.shape} and decoder_input_ids {decoder_inputs.shape} must be "
                "2-D with the same batch size"
            )
        rows = len(inputs)
        padded = self.shapes.batch_size * -(-rows // self.shapes.batch_size)
        pad = ((0, padded - rows), (0, 0))
        forward = self._forward()
        out = [
            np.asarray(forward(self.params, inputs_chunk, decoder_chunk))
            for inputs_chunk, decoder_chunk in zip(
                np.split(np.pad(inputs, pad), padded // self.shapes.batch_size),
                np.split(np.pad(decoder_inputs, pad), padded // self.shapes.batch_size),
                strict=True,
            )
        ]
        return np.concatenate(out)[:rows]

    # --- text in and out ------------------------------------------------------------------

    def predict(
        self,
        inputs: list[str],
        *,
        num_beams: int = 1,
        temperature: float = 0.0,
        top_k: int = 0,
        max_length: int | None = None,
        seed: int = 0,
    ) -> list[str]:
        """The model's output text for each input (in the task's format, e.g. 'question: ...
        context: ...'); see generate_ids for the decoding settings."""
        settings = self._settings(max_length, num_beams, temperature, top_k, seed)
        return self._predict_texts(_texts(inputs), first=0, settings=settings)

    def predict_iter(
        self, inputs: Iterable[str], *, batch_size: int = 1024, **settings
    ) -> Iterator[str]:
        """predict's output for each input of an iterable, in order, as it goes: `batch_size`
        inputs are read, decoded (batched by length) and yielded at a time, so a stream of any
        length takes the memory of one such group. `settings` as predict's."""
        _check_count("batch_size", batch_size)
        chosen = self._settings(
            settings.pop("max_length", None), **{**_DEFAULTS, **_known(settings)}
        )
        iterator = iter(inputs)
        first = 0
        while group := list(itertools.islice(iterator, batch_size)):
            yield from self._predict_texts(_texts(group), first=first, settings=chosen)
            first += len(group)

    def predict_file(
        self, input_file: str, output_file: str, *, chunk_size: int = 4096, **settings
    ) -> str:
        """Decodes a text file (one input per line; a glob or a comma list of files too) into
        a JSON-lines file of {"input", "prediction"}, as `t5tpu infer` does: in chunks saved
        beside it, so calling again after an interruption continues where it stopped, and the
        result is the same bytes. Returns `output_file`."""
        from t5tpu.api import prediction_file

        _check_count("chunk_size", chunk_size)
        chosen = self._settings(
            settings.pop("max_length", None), **{**_DEFAULTS, **_known(settings)}
        )
        return prediction_file.write(
            input_file,
            output_file,
            decode=lambda texts, first: self._predict_texts(texts, first=first, settings=chosen),
            identity={
                "model": self.source,
                "max_length": chosen.max_length,
                "settings": dataclasses.asdict(chosen.decoding),
            },
            chunk_size=chunk_size,
        )

    def _predict_texts(self, texts: list[str], *, first: int, settings: _Settings) -> list[str]:
        """Texts decoded in batches of similar length (fewer, shorter padded shapes); `first` is
        the place of texts[0] among all the inputs."""
        encoded = [self._encode(text) for text in texts]
        order = sorted(range(len(texts)), key=lambda i: len(encoded[i]))
        ids = self._generate([encoded[i] for i in order], [first + i for i in order], settings)
        decoded = [""] * len(texts)
        for i, row in zip(order, ids, strict=True):
            decoded[i] = self.vocabulary.decode(row.tolist())
        return decoded

    def score(self, inputs: list[str], targets: list[str]) -> np.ndarray:
        """float32 log-likelihood of each target given its input, summed over the target's
        tokens (EOS included), as `t5tpu eval` scores."""
        inputs, targets = _texts(inputs), _texts(targets)
        if len(inputs) != len(targets):
            raise UserError(f"{len(inputs)} inputs but {len(targets)} targets")
        encoded = [self._encode(text) for text in inputs]
        wanted = [self._encode(text, self.shapes.max_target_length) for text in targets]
        scorer = self._scorer()
        scores = []
        for start in range(0, len(encoded), self.shapes.batch_size):
            rows = slice(start, start + self.shapes.batch_size)
            chunk = wanted[rows]
            length = self.shapes.bucket(max(map(len, chunk)), self.shapes.max_target_length)
            target_ids = _padded(chunk, length, self.shapes.batch_size)
            decoder_inputs = np.pad(target_ids, ((0, 0), (1, 0)))[:, :-1]  # shifted right
            input_ids = self._input_tokens(encoded[rows])
            result = scorer(self.params, input_ids, decoder_inputs, target_ids)
            scores.append(np.asarray(result)[: len(chunk)])
        return np.concatenate(scores) if scores else np.zeros((0,), np.float32)

    # --- batching ---------------------------------------------------------------------------

    def _encode(self, text: str, limit: int | None = None) -> list[int]:
        """Ids of `text` ending in EOS, truncated to `limit` (default: max_input_length) with EOS
        kept, as the tasks' preprocessing does."""
        limit = limit or self.shapes.max_input_length
        return self.vocabulary.encode(text)[: limit - 1] + [self.vocabulary.eos_id]

    def _chunks(self, rows: list) -> list[list]:
        size = self.shapes.batch_size
        return [rows[start : start + size] for start in range(0, len(rows), size)]

    def _input_tokens(self, rows: list[list[int]]) -> np.ndarray:
        length = self.shapes.bucket(max(map(len, rows)), self.shapes.max_input_length)
        return _padded(rows, length, self.shapes.batch_size)

    # --- compiled programs, one per shape and settings ---------------------------------------

    def _jit(self, fn, *, batch_args: int, replicated_args: int = 0):
        batch, replicated = self._partitioner.batch_sharding(), self._partitioner.replicated()
        return self._partitioner.jit(
            fn,
            in_shardings=(
                self._param_shardings,
                *[batch] * batch_args,
                *[replicated] * replicated_args,
            ),
            out_shardings=replicated,
        )

    def _program(self, key: tuple, build):
        """The compiled program `key`, built on first use and kept on this object: a cache on
        the class would keep every model, and its parameters, alive until the process ends."""
        if key not in self._programs:
            self._programs[key] = build()
        return self._programs[key]

    # The traced functions close over the network only, never `self` (which holds the
    # parameters): a program kept by jax's own caches must not keep the model alive.

    def _decoder(self, max_length: int, settings: decoding.DecodingSettings):
        network = self.model

        def decode(params, tokens, rng):
            batch = {"encoder_input_tokens": tokens}
            return network.predict(params, batch, max_length, rng, settings)

        return self._program(
            ("decode", max_length, settings),
            lambda: self._jit(decode, batch_args=2),
        )

    def _forward(self):
        network = self.model

        def forward(params, inputs, decoder_inputs):
            batch = {"encoder_input_tokens": inputs, "decoder_input_tokens": decoder_inputs}
            return network.logits(params, batch).astype(jnp.float32)

        return self._program(("forward",), lambda: self._jit(forward, batch_args=2))

    def _scorer(self):
        network = self.model

        def score(params, inputs, decoder_inputs, targets):
            batch = {
                "encoder_input_tokens": inputs,
                "decoder_input_tokens": decoder_inputs,
                "decoder_target_tokens": targets,
            }
            return network.score(params, batch)

        return self._program(("score",), lambda: self._jit(score, batch_args=3))


@dataclasses.dataclass(frozen=True)
class _Settings:
    """A call's decoding: the longest output and how each token is picked."""

    max_length: int
    decoding: decoding.DecodingSettings


_DEFAULTS = {"num_beams": 1, "temperature": 0.0, "top_k": 0, "seed": 0}


def _known(settings: dict) -> dict:
    unknown = sorted(set(settings) - set(_DEFAULTS))
    if unknown:
        raise UserError(
            f"unknown decoding setting {unknown[0]!r}; use max_length, "
            + ", ".join(sorted(_DEFAULTS))
        )
    return settings


def _texts(values) -> list[str]:
    """A list of strings; a single string is a common slip, so it is refused, not split."""
    if isinstance(values, str):
        raise UserError("pass a list of strings (one per example), not a single string")
    values = list(values)
    wrong = [type(v).__name__ for v in values if not isinstance(v, str)]
    if wrong:
        raise UserError(f"expected strings, got {wrong[0]}")
    return values
