"""The model side of the server: the rows requests queue, and the worker that runs each group of
them through the engine (t5tpu/model/engine.py) that `t5tpu infer` and the Python API use.

Only the batcher's worker thread calls `run_group` (and `warm_up`); `encode` is called from the
request threads (SentencePiece is thread-safe).

Decoding groups run as continuous batches: a row is answered as soon as it finishes, and rows
of the same group that arrive while a batch decodes join it as slots free up (the batch looks
for them every few steps). A batch holds rows of one input-length bucket and has the smallest
of a few row counts (--max_batch_size and its quarters) that holds the rows waiting when it
starts; when more rows wait than it has room for, it takes no more, and a larger batch takes
them once its own rows are done. Sampling draws each row from its own key, `fold_in(
PRNGKey(seed), index of the row in its request)`, the key `t5tpu infer` gives the input at that
index: a request decodes as `t5tpu infer` of its instances does, whichever requests shared its
batch. Every setting but beam search's width is a value of the warmed programs; a new width's
programs compile in a thread beside the model's (`ready`), kept with a bounded number of
others by last use. With LoRA adapters, every group runs on the adapters' engine
(lora_adapters.py), set to its adapter's parameters first (the base's: adapters of zeros).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from t5tpu.api import streaming
from t5tpu.api.model import T5Model
from t5tpu.model.decoding_settings import DecodingSettings
from t5tpu.model.engine import Encoded, Engine, Request, Row
from t5tpu.serve.batcher import GroupFeed
from t5tpu.serve.lora_adapters import ServedAdapters
from t5tpu.storage.run_record import RunRecord
from t5tpu.tasks import shaping

# A decoding batch looks for newly queued rows of its group at least this many steps apart;
# a batch of streamed rows hands out their new text this often.
_POLL_STEPS = 8
_STREAM_STEPS = 2
# The settings that are each row's own values, at their defaults: a group's rows may differ in
# them (greedy and sampling rows decode in one batch).
_VALUES = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0}
_VALUES.update(no_repeat_ngram_size=0, min_new_tokens=0)


@dataclasses.dataclass(frozen=True)
class ScoreRow:
    input_ids: tuple[int, ...]
    target_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Group:
    """Rows one program runs together: 'decode' with its settings, or 'score'; the padded
    length of their inputs; the LoRA adapter they run with (None: the base alone). Rows batch
    only with their length bucket: a short input padded to a long one's bucket would cost as
    much encoder time as the long one, and on a CPU the encoder is often most of a request.
    Streamed rows batch apart: their batches end a segment every _STREAM_STEPS tokens to hand
    out their text, where others run _POLL_STEPS."""

    kind: str
    length: int
    decoding: DecodingSettings | None = None
    adapter: str | None = None
    streams: bool = False

    @classmethod
    def for_decoding(
        cls,
        settings: DecodingSettings,
        length: int,
        adapter: str | None = None,
        streams: bool = False,
    ) -> Group:
        # The seed only picks row keys, and the values are each row's (engine.Row's
        # `settings`): rows of every seed, temperature, top_k, top_p, penalty and length share
        # a batch (ModelWorker._request; max_new_tokens None: each row's), as beam search's rows of
        # one width do whatever their length penalty, length and num_return_sequences.
        values = _VALUES if settings.num_beams == 1 else {"num_return_sequences": 1}
        values = {**values, "length_penalty": None}
        settings = dataclasses.replace(
            settings, **values, beam_alpha=0.6, max_new_tokens=None, seed=0
        )
        return cls("decode", length, settings, adapter, streams)

    @classmethod
    def for_scoring(cls, length: int, adapter: str | None = None) -> Group:
        return cls("score", length, adapter=adapter)


class _QueuedRows:
    """The engine's Feed over a group's queue: the rows waiting now, as engine Rows tagged with
    their queue entries."""

    def __init__(self, feed: GroupFeed, *, bucket: int, first: int):
        self._feed, self._bucket = feed, bucket
        self._held = []
        self._first = first

    def next_bucket(self) -> int | None:
        if not self._held:
            self._held = self._feed.take(self._first)
        return self._bucket if self._held else None

    def take(self, count: int, bucket: int) -> list[Row]:
        taken, self._held = self._held[:count], self._held[count:]
        taken += self._feed.take(count - len(taken)) if count > len(taken) else []
        return [dataclasses.replace(t.item, tag=t) for t in taken]  # answered through `tag`


@dataclasses.dataclass(frozen=True)
class Answering:
    """How one served model (the base, or an adapter) answers: as its run trained it (`record`;
    None: one that records none), its inputs cut to `input_length`, decoded with `defaults`
    (max_new_tokens: its target length) unless a request says otherwise."""

    record: RunRecord | None
    input_length: int
    defaults: DecodingSettings


class Runs:
    """How the served model (None) and each adapter answer: the tasks each was trained on, how
    each shapes and cuts its inputs, its decoding defaults."""

    def __init__(self, answering: dict[str | None, Answering]):
        self._answering = answering

    def tasks(self, adapter: str | None) -> tuple[str, ...]:
        """The tasks the base's run (or `adapter`'s) trained on; () when it does not say."""
        run = self._answering[adapter].record
        return run.tasks if run else ()

    def model_inputs(self, texts, *, adapter: str | None, exact: bool) -> list[str]:
        """The texts as the base's run (or `adapter`'s) shaped its training inputs; `exact`
        (the "exact_inputs" parameter): as they are."""
        run = self._answering[adapter].record
        if exact or run is None:
            return list(texts)
        return [shaping.shape(run.shaping, text) for text in texts]

    def input_length(self, adapter: str | None) -> int:
        return self._answering[adapter].input_length

    def defaults(self, adapter: str | None) -> DecodingSettings:
        return self._answering[adapter].defaults


def _listener(row: Row):
    """A queued row's streams.Listener (its request's own row's tag), None if not streamed."""
    return row.tag.item.tag


def _left(row: Row) -> bool:
    """Whether a streamed row's client has gone (its slot is then freed)."""
    listener = _listener(row)
    return listener is not None and listener.left


class ModelWorker:
    """A loaded T5Model's engine, and its LoRA adapters' if any, run group by group for the
    server."""

    def __init__(
        self,
        *,
        model: T5Model,
        max_batch_size: int,
        defaults: DecodingSettings,
        adapters: ServedAdapters | None = None,
        runs: Runs | None = None,
    ):
        """`defaults`: the served model's own, whose programs are compiled at warm-up; `runs`:
        how it and each adapter answer (default: the model's run, at the model's lengths)."""
        self.vocabulary = model.vocabulary
        self._eos = model.vocabulary.eos_id
        base = Answering(model.run_record, model.shapes.max_input_length, defaults)
        self.runs = runs or Runs({None: base})
        self.vocab_size = model.config.vocab_size
        self.max_input_length = model.shapes.max_input_length
        self.max_target_length = model.shapes.max_target_length
        self.defaults = defaults
        self.adapters = adapters
        self.adapter_names = adapters.names if adapters else ()
        # With adapters, their engine runs the base too (as an adapter of zeros): one set of
        # programs. Without, the model's own: its parameters, cast once, and its programs.
        self.engine = adapters.engine if adapters else model.engine
        self.engine.serve(batch_size=max_batch_size, pinned=self._request(defaults))
        self.batch_sizes = self.engine.slot_counts
        self._compiling_lock = threading.Lock()
        self._one_compile = threading.Lock()  # compiles take turns (each keeps a core busy)
        self._compiling: set[tuple] = set()
        self._compile_failed: set[tuple] = set()

    @property
    def program_count(self) -> int:
        return self.engine.program_count

    @property
    def programs_needed(self) -> int:
        """The programs warm_up compiles (docs/SERVING.md has the formula)."""
        return self.engine.programs_needed(self._request(self.defaults))

    def encode(self, text: str, limit: int) -> Encoded:
        return self.engine.encode(text, limit)

    def input_bucket(self, ids: tuple[int, ...]) -> int:
        """The padded length of an input (of its batch, which holds only its bucket's)."""
        return self.engine.bucket(len(ids))

    def warm_up(self, *, stopping: Callable[[], bool] = lambda: False) -> int:
        """Compiles the default settings' decoding programs for every shape a batch can take
        (until `stopping()` says otherwise); returns how many programs are ready."""
        return self.engine.warm_up(self._request(self.defaults), stopping=stopping)

    def ready(self, group: Group, wake: Callable[[], None]) -> bool:
        """The batcher's `ready`: whether a group's programs exist. Beam search's of a width
        not met before are compiled in a thread of their own, and `wake()` called when they
        are, while the model's thread decodes other groups: a request with a new num_beams
        waits for its compile, the others do not. (Every other setting is a value of the
        warmed programs.)"""
        if group.kind != "decode" or group.decoding.num_beams == 1:
            return True
        request = self._request(group.decoding)
        key = (request.family, group.length)
        with self._compiling_lock:
            if key in self._compile_failed or self.engine.has_beam_programs(request, key[1]):
                return True  # a failed compile fails its rows in run_group, with its error
            if key not in self._compiling:
                self._compiling.add(key)
                # A daemon thread: a stop signal need not wait for a compile to end.
                compiling = (request, key, wake)
                threading.Thread(target=self._compile_beam, args=compiling, daemon=True).start()
        return False

    def _compile_beam(self, request: Request, key: tuple, wake: Callable[[], None]) -> None:
        try:
            with self._one_compile:
                self.engine.compile_beam(request, key[1])
        except Exception:
            with self._compiling_lock:
                self._compile_failed.add(key)
        finally:
            with self._compiling_lock:
                self._compiling.discard(key)
            wake()

    def _engine(self, adapter: str | None) -> Engine:
        return self.adapters.engine_for(adapter) if self.adapters else self.engine

    def run_group(self, group: Group, feed: GroupFeed) -> None:
        """The batcher's `run_group`: texts for 'decode' rows, log-likelihoods for 'score',
        each answered as soon as it is ready."""
        engine = self._engine(group.adapter)
        if group.kind == "score":
            rows = feed.take(engine.batch_size)
            inputs = [row.item.input_ids for row in rows]
            scores = engine.score(inputs, [row.item.target_ids for row in rows])
            for row, score in zip(rows, scores, strict=True):
                feed.answer(row, float(score))
            return
        queued = _QueuedRows(feed, bucket=group.length, first=engine.batch_size)
        request = self._request(group.decoding)
        watched = {"partial": _listener, "left": _left}
        steps = _STREAM_STEPS if group.streams else _POLL_STEPS
        for decoded in engine.stream(queued, request, poll_steps=steps, **watched):
            listener = _listener(decoded.row)
            if decoded.state == "decoding":
                listener.progress(decoded.ids)
            elif decoded.state == "left":
                feed.answer(decoded.row.tag, None)  # no one waits for it now
            elif (decoded.row.settings or request.settings).num_return_sequences > 1:
                feed.answer(decoded.row.tag, self._n_best(decoded))
            else:
                text = self.vocabulary.decode(decoded.ids.tolist())
                if listener is not None:
                    listener.finish(text, streaming.finish_reason(decoded.ids, self._eos))
                feed.answer(decoded.row.tag, text)

    def _n_best(self, decoded) -> list[dict]:
        """Beam search's n best of a row: {"prediction", "score"} each, best first."""
        texts = [self.vocabulary.decode(ids.tolist()) for ids in decoded.sequences]
        return [
            {"prediction": text, "score": float(score)}
            for text, score in zip(texts, decoded.scores, strict=True)
        ]

    def row_settings(self, wanted: DecodingSettings) -> DecodingSettings | None:
        """A request's own values, which its rows carry (None: the group's do)."""
        settings = self._request(wanted).settings
        own = settings.samples or settings.penalizes or settings.num_beams > 1
        return settings if own or settings.max_new_tokens is not None else None

    def _request(self, wanted: DecodingSettings) -> Request:
        """Programs decode up to the longest output served; a row stops at its own
        max_new_tokens (a value, so no length compiles programs of its own)."""
        served = self.max_target_length
        own = wanted.max_new_tokens
        own = own if own is not None and own < served else None  # None: a group's
        return Request(dataclasses.replace(wanted, max_new_tokens=own), served)
