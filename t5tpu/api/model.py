"""T5Model: a loaded T5 to call from Python — text in and out, ids in and out, scores.

Every call runs through the engine (t5tpu/model/engine.py) that `t5tpu infer` and `t5tpu serve`
use: inputs batched by length and padded to a few lengths and row counts, so calls of similar
sizes reuse one compiled program, and rows that finish early make room for the next. A notebook
that keeps calling `predict` with the same settings compiles a handful of times, not once per
call. Parameters are cast once, at load, to the model's activation dtype (`t5tpu.load(...,
dtype='bfloat16')`).

A model answers as its run trained it (its run record, storage/run_record.py): text inputs are
shaped as the run's task shaped its training inputs (text_to_text's INPUT_PREFIX put before
them, Quora's questions lower-cased; `exact_inputs=True` passes them as they are), cut to the
run's input length, and decoded with the run's defaults up to its target length. Asking a
Quora- or SQuAD-trained model in its task's own words is done by the tasks
(`t5tpu.tasks.quora.is_duplicate(model, ...)`, `t5tpu.tasks.squad.answer`), which refuse a model
trained on another task.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator

import jax
import numpy as np

from t5tpu import validators
from t5tpu.api import streaming
from t5tpu.errors import UserError
from t5tpu.model import decoding_settings, layers
from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.model.engine import Engine, ListFeed, Request, Row, encode
from t5tpu.partitioning import Partitioner
from t5tpu.storage.run_record import InputShaping, RunRecord
from t5tpu.tasks import shaping

# Rows, lengths and chunks: True is an int to Python, not a count.
_COUNT = validators.whole(low=1)
# stream() gives out each input's new text at least this many tokens apart.
_STREAM_STEPS = 2


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
            _COUNT.check(name, value)
        # Each device takes an equal share of the rows.
        rows = -(-batch_size // data_parallelism) * data_parallelism
        return cls(rows, max_input_length, max_target_length)


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
        record: RunRecord | None = None,
    ):
        self.model = model
        self.shapes = shapes
        self.source = source
        # What the run decided (None: the checkpoint does not say): the tasks the helpers
        # check, the shaping of text inputs, the decoding defaults.
        self.run_record = record
        self.tasks: tuple[str, ...] = record.tasks if record else ()
        self.input_shaping = record.shaping if record else InputShaping()
        self.decoding_defaults = record.decoding if record else decoding_settings.DecodingSettings()
        self._has_vocabulary = has_vocabulary
        self.engine = Engine(
            model=model,
            params=params,
            param_shardings=param_shardings,
            partitioner=partitioner,
            batch_size=shapes.batch_size,
            max_input_length=shapes.max_input_length,
            max_target_length=shapes.max_target_length,
        )

    @property
    def config(self):
        """The network's T5Config (the `model`'s, an EncoderDecoderModel, which the engine
        runs)."""
        return self.model.config

    @property
    def params(self):
        """The parameters on the devices, in the model's dtype (a copy of the embedding table,
        which the engine holds as its bits in bfloat16)."""
        return layers.embeddings_from_bits(self.engine.params)

    def __repr__(self) -> str:
        count = sum(x.size for x in jax.tree_util.tree_leaves(self.engine.params))
        shapes = self.shapes
        task = f", trained on {self.run_record.task}" if self.run_record else ""
        return (
            f"T5Model({self.source!r}, {count:,} parameters{task}; inputs of up to "
            f"{shapes.max_input_length} tokens, {shaping.describe(self.input_shaping)}; outputs "
            f"of up to {shapes.max_target_length})"
        )

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
        num_beams: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        repetition_penalty: float | None = None,
        no_repeat_ngram_size: int | None = None,
        min_new_tokens: int | None = None,
        beam_alpha: float | None = None,
        num_return_sequences: int | None = None,
        length_penalty: float | None = None,
    ) -> np.ndarray:
        """[len(input_ids), max_new_tokens] decoded ids, each row ending at EOS then zeros;
        [len(input_ids), num_return_sequences, max_new_tokens] with beam search's n best.

        input_ids: rows of token ids (a 2-D array with 0 as padding, or lists), ending with EOS
        as a tokenizer writes them. num_beams > 1 is beam search (T5X's length penalty
        beam_alpha, the run's or 0.6; 0 ranks by log-likelihood alone; or, given, Hugging
        Face's length_penalty and stopping rule, as its generate does); temperature > 0
        samples (from the top_k most likely tokens when top_k > 0, then the fewest whose
        probability reaches top_p when it is below 1, as Hugging Face's warpers do), seeded.
        Greedy and sampling take Hugging Face's repetition_penalty, no_repeat_ngram_size and
        min_new_tokens. Each setting left None is the run's (`decoding_defaults`), the length
        the model's max_target_length.
        """
        request = self._settings(**_options(locals()))
        return self._generate(_ids_rows(input_ids), request)

    def _settings(self, **given):
        """The Request of a call: each decoding option given (decoding_settings' names or
        aliases; None: the run's default), checked as every front end checks them; the
        length the model's max_target_length unless max_new_tokens says."""
        given = {name: value for name, value in given.items() if value is not None}
        chosen = decoding_settings.given(given, self.decoding_defaults)
        chosen.check(self.config.vocab_size, name=decoding_settings.as_given(given, str))
        length = chosen.max_new_tokens or self.shapes.max_target_length
        return Request(dataclasses.replace(chosen, max_new_tokens=None), length)

    def _generate(self, rows: list, request: Request, first: int = 0) -> np.ndarray:
        """Decoded ids of `rows`; row i samples with the key of index first + i among all the
        inputs (decoding.row_keys), so a row samples alike in any batch."""
        n = request.settings.num_return_sequences
        if not rows:
            return np.zeros((0, *([n] if n > 1 else []), request.max_length), np.int32)
        if n == 1:
            return np.stack(self.engine.generate(rows, request, first=first))
        return np.stack([d.sequences for d in self.engine.decoded(rows, request, first=first)])

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
        return self.engine.logits(inputs, decoder_inputs)

    # --- text in and out ------------------------------------------------------------------

    def predict(
        self,
        inputs: list[str],
        *,
        num_beams: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        max_new_tokens: int | None = None,
        max_length: int | None = None,
        seed: int | None = None,
        repetition_penalty: float | None = None,
        no_repeat_ngram_size: int | None = None,
        min_new_tokens: int | None = None,
        beam_alpha: float | None = None,
        num_return_sequences: int | None = None,
        length_penalty: float | None = None,
        exact_inputs: bool = False,
    ) -> list[str] | list[list[str]]:
        """The model's output text for each input (a list of num_return_sequences, best
        first, with beam search's n best), each input first shaped as the run's task shaped its
        training inputs (`exact_inputs=True`: taken as the model input as it is); see
        generate_ids for the decoding settings (max_length: max_new_tokens' earlier name)."""
        settings = self._settings(**_options(locals()))
        rows = self.model_inputs(_texts(inputs), exact_inputs=exact_inputs)
        return self._predict_texts(rows, first=0, settings=settings)

    def model_inputs(self, texts: list[str], *, exact_inputs: bool = False) -> list[str]:
        """The texts the model is given for `texts` (see predict)."""
        validators.boolean().check("exact_inputs", exact_inputs)
        if exact_inputs:
            return list(texts)
        return [shaping.shape(self.input_shaping, text) for text in texts]

    def predict_iter(
        self, inputs: Iterable[str], *, batch_size: int = 1024, **settings
    ) -> Iterator[str]:
        """predict's output for each input of an iterable, in order, as it goes: `batch_size`
        inputs are read, decoded (batched by length) and yielded at a time, so a stream of any
        length takes the memory of one such group. `settings` as predict's."""
        _COUNT.check("batch_size", batch_size)
        exact = _known(settings).pop("exact_inputs", False)
        chosen = self._settings(**settings)
        iterator = iter(inputs)
        first = 0
        while group := list(itertools.islice(iterator, batch_size)):
            rows = self.model_inputs(_texts(group), exact_inputs=exact)
            yield from self._predict_texts(rows, first=first, settings=chosen)
            first += len(group)

    def stream(self, inputs: list[str], **settings) -> Iterator[streaming.Piece]:
        """predict's answers as they decode: streaming.Piece(index, text) as each input's
        answer grows (a few tokens at a time), its last piece with the whole `prediction` and
        its `finish_reason`; each input's texts join to its prediction. Inputs of one padded
        length decode together, so pieces of different inputs interleave. `settings` as
        predict's; beam search gives each answer whole."""
        exact = _known(settings).pop("exact_inputs", False)
        request = self._settings(**settings)
        if request.settings.num_return_sequences > 1:
            raise UserError("stream gives one answer an input: leave num_return_sequences at 1")
        texts = self.model_inputs(_texts(inputs), exact_inputs=exact)
        rows = [
            Row(self._encode(text), i, request.settings.seed, tag=i) for i, text in enumerate(texts)
        ]
        engine = self.engine
        feed = ListFeed(rows, bucket=engine.bucket, fill=engine.few_rows)
        deltas = [streaming.TextDeltas(self.vocabulary.decode) for _ in rows]
        wanted = lambda row: True  # noqa: E731 - every row is streamed
        for decoded in engine.stream(feed, request, poll_steps=_STREAM_STEPS, partial=wanted):
            index, ids = decoded.row.tag, decoded.ids
            if decoded.state == "decoding":
                if piece := deltas[index].update(ids):
                    yield streaming.Piece(index, piece)
                continue
            answer = self.vocabulary.decode(ids.tolist())
            reason = streaming.finish_reason(ids, self.vocabulary.eos_id)
            yield streaming.Piece(index, deltas[index].finish(answer), answer, reason)

    def predict_file(
        self, input_file: str, output_file: str, *, chunk_size: int = 4096, **settings
    ) -> str:
        """Decodes a text file (one input per line; a glob or a comma list of files too) into
        a JSON-lines file of {"input", "prediction"} (and "model_input", the shaped input, when
        the model shapes its inputs), as `t5tpu infer` does: in chunks saved beside it, so
        calling again after an interruption continues where it stopped, and the result is the
        same bytes. `settings` as predict's. Returns `output_file`."""
        from t5tpu.api import predict_file

        _COUNT.check("chunk_size", chunk_size)
        exact = _known(settings).pop("exact_inputs", False)
        chosen = self._settings(**settings)
        shaped = None if exact else self.input_shaping
        return predict_file.write(
            input_file,
            output_file,
            decode=lambda texts, first: self._predict_texts(texts, first=first, settings=chosen),
            shape=lambda texts: self.model_inputs(texts, exact_inputs=exact),
            identity={
                "model": self.source,
                "max_length": chosen.max_length,
                "settings": dataclasses.asdict(chosen.settings),
                "lengths": [self.shapes.max_input_length, self.shapes.max_target_length],
                "shaping": shaped.record() if shaped else "exact",
            },
            chunk_size=chunk_size,
            shapes_inputs=shaped is not None and shaped.changes_inputs,
        )

    def _predict_texts(self, texts: list[str], *, first: int, settings: Request) -> list[str]:
        """Model inputs decoded; `first` is the place of texts[0] among all the inputs."""
        rows = [self._encode(text) for text in texts]
        ids = self._generate(rows, settings, first=first)
        decode = self.vocabulary.decode
        if settings.settings.num_return_sequences > 1:
            return [[decode(one.tolist()) for one in row] for row in ids]
        return [decode(row.tolist()) for row in ids]

    def score(self, inputs: list[str], targets: list[str], *, exact_inputs: bool = False):
        """float32 log-likelihood of each target given its input (shaped as predict's),
        summed over the target's tokens (EOS included), as `t5tpu eval` scores."""
        inputs, targets = _texts(inputs), _texts(targets)
        if len(inputs) != len(targets):
            raise UserError(f"{len(inputs)} inputs but {len(targets)} targets")
        shaped = self.model_inputs(inputs, exact_inputs=exact_inputs)
        encoded = [self._encode(text) for text in shaped]
        wanted = [self._encode(text, self.shapes.max_target_length) for text in targets]
        return self.engine.score(encoded, wanted)

    def _encode(self, text: str, limit: int | None = None) -> tuple[int, ...]:
        """Ids of `text` ending in EOS, cut to `limit` (default: max_input_length) with EOS
        kept, as the tasks' preprocessing does."""
        return encode(self.vocabulary, text, limit or self.shapes.max_input_length).ids


# What predict_iter, predict_file and the like take: predict's keywords.
_SETTINGS = (*decoding_settings.NAMES, *decoding_settings.ALIASES, "exact_inputs")


def _options(arguments: dict) -> dict:
    """The decoding options among a method's arguments (its `locals()`)."""
    names = (*decoding_settings.NAMES, *decoding_settings.ALIASES)
    return {name: arguments[name] for name in names if name in arguments}


def _known(settings: dict) -> dict:
    unknown = sorted(set(settings) - set(_SETTINGS))
    if unknown:
        raise UserError(
            f"unknown decoding setting {unknown[0]!r}; use " + ", ".join(sorted(_SETTINGS))
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
