"""The engine (t5tpu/model/engine.py) that infer, the Python API and serve share: continuous
batches decode every row exactly as that row decodes alone, greedy and sampled, while rows that
finish leave the batch and waiting rows take their slots."""

from __future__ import annotations

import dataclasses

import flax
import jax
import numpy as np
import pytest
import reference_decoding
import seqio

from t5tpu.model import decoding, decoding_settings, engine, param_shapes, slot_batch
from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.partitioning import Partitioner
from t5tpu.runtime import compile_events

MAX_LENGTH = 12
EOS = 1


@pytest.fixture(scope="module")
def tiny():
    """A random tiny model whose output layer favours EOS enough that greedy outputs end at
    uneven lengths, and 13 inputs of uneven lengths (two input buckets)."""
    from tiny import tiny_config

    model = EncoderDecoderModel(tiny_config(), seqio.PassThroughVocabulary(1024, eos_id=EOS))
    partitioner = Partitioner()
    _, shardings = param_shapes.sharded_abstract_params(model.config, partitioner)
    params = flax.core.meta.unbox(model.init(jax.random.PRNGKey(0), 8, 8))
    kernel = params["decoder"]["logits_dense"]["kernel"]
    params["decoder"]["logits_dense"]["kernel"] = kernel.at[:, EOS].multiply(5.0)
    rng = np.random.default_rng(0)
    rows = [tuple(rng.integers(2, 1000, size=rng.integers(3, 30))) + (EOS,) for _ in range(13)]
    return model, params, shardings, partitioner, rows


def _engine(tiny, batch_size: int, smaller_batches: bool = False) -> engine.Engine:
    model, params, shardings, partitioner, _ = tiny
    return engine.Engine(
        smaller_batches=smaller_batches,
        model=model,
        params=params,
        param_shardings=shardings,
        partitioner=partitioner,
        batch_size=batch_size,
        max_input_length=32,
        max_target_length=MAX_LENGTH,
    )


def _alone(tiny, settings: decoding_settings.DecodingSettings) -> list[np.ndarray]:
    """Each row decoded in a batch of its own by the whole-batch reference decoder."""
    model, params, _, _, rows = tiny
    decode = jax.jit(
        lambda p, t, k: reference_decoding.predict(model, p, t, MAX_LENGTH, k, settings)
    )
    out = []
    for index, ids in enumerate(rows):
        tokens = slot_batch.padded([ids], 1, engine.bucket_length(len(ids), 32))
        keys = decoding.row_keys(settings.seed, [index]) if settings.samples else None
        out.append(np.asarray(decode(params, tokens, keys))[0])
    return out


def _length(ids: np.ndarray) -> int:
    return int(np.argmax(ids == EOS)) + 1 if EOS in ids else len(ids)


@pytest.mark.parametrize(
    "settings",
    [
        decoding_settings.DecodingSettings(),
        decoding_settings.DecodingSettings(temperature=1.0, top_k=20, seed=3),
        decoding_settings.DecodingSettings(temperature=0.8, top_k=50, top_p=0.9, seed=5),
    ],
    ids=["greedy", "sampled", "top_p"],
)
def test_rows_that_finish_leave_and_every_row_decodes_as_alone(tiny, settings, monkeypatch):
    inserted = []
    insert = slot_batch.SlotBatch.insert
    monkeypatch.setattr(
        slot_batch.SlotBatch,
        "insert",
        lambda self, rows: inserted.append(len(rows)) or insert(self, rows),
    )
    got = _engine(tiny, batch_size=4).generate(tiny[4], engine.Request(settings, MAX_LENGTH))
    expected = _alone(tiny, settings)
    for index, (row, alone) in enumerate(zip(got, expected, strict=True)):
        np.testing.assert_array_equal(row, alone, err_msg=f"row {index}")
    assert len({_length(row) for row in got}) >= 4, "outputs should end at uneven lengths"
    # 13 rows through 4 slots: some joined a batch whose other rows were still decoding.
    assert sum(inserted) == 13 and len([n for n in inserted if n]) > 4


def test_several_samples_of_a_row_are_those_of_its_copies_best_first(tiny):
    """num_return_sequences with sampling: sample j of row i is what a row of index i * n + j
    draws alone, the samples ranked by the model's log-likelihood, which the scores are."""
    n, rows = 3, tiny[4][:5]
    settings = decoding_settings.DecodingSettings(temperature=1.0, top_k=50, seed=4)
    server = _engine(tiny, batch_size=4)
    several = dataclasses.replace(settings, num_return_sequences=n)
    got = server.decoded(rows, engine.Request(several, MAX_LENGTH), first=2)
    copies = [ids for ids in rows for _ in range(n)]
    alone = server.generate(copies, engine.Request(settings, MAX_LENGTH), first=2 * n)
    for i, decoded in enumerate(got):
        assert decoded.sequences.shape == (n, MAX_LENGTH)
        assert sorted(map(tuple, decoded.sequences)) == sorted(
            map(tuple, alone[i * n : (i + 1) * n])
        )
        np.testing.assert_array_equal(decoded.ids, decoded.sequences[0])
        assert list(decoded.scores) == sorted(decoded.scores, reverse=True)
        targets = [tuple(ids[: _length(ids)]) for ids in decoded.sequences]
        np.testing.assert_allclose(decoded.scores, server.score([rows[i]] * n, targets), rtol=1e-6)
    assert len({tuple(s) for d in got for s in d.sequences}) > len(rows)  # samples differ


def test_a_server_batch_that_rows_outgrow_leaves_them_to_a_larger_one(tiny, monkeypatch):
    counts = []
    start = slot_batch.SlotBatch.__init__

    def recorded(self, *, engine, request, shape):
        counts.append(shape.count)
        start(self, engine=engine, request=request, shape=shape)

    monkeypatch.setattr(slot_batch.SlotBatch, "__init__", recorded)
    settings = decoding_settings.DecodingSettings(temperature=1.0, seed=5)
    feed = _Trickle(tiny[4])  # one row at first, then the rest after the first segment
    got = {}
    server = _engine(tiny, batch_size=8, smaller_batches=True)
    assert server.slot_counts == (2, 8)
    for decoded in server.stream(feed, engine.Request(settings, MAX_LENGTH), poll_steps=2):
        got[decoded.row.index] = decoded.ids
    expected = _alone(tiny, settings)
    for index, alone in enumerate(expected):
        np.testing.assert_array_equal(got[index], alone, err_msg=f"row {index}")
    assert counts[0] == 2 and 8 in counts, counts


class _Trickle:
    """A feed with one row waiting at first and every other row after that, as a server's
    requests arrive: a batch started small is outgrown."""

    def __init__(self, rows):
        self._rows = [engine.Row(ids, index=i, seed=5) for i, ids in enumerate(rows)]
        self._takes = 0

    def next_bucket(self):
        return engine.bucket_length(len(self._rows[0].ids), 32) if self._rows else None

    def take(self, count, bucket):
        # The batch asks twice before its first segment (its rows, then any others waiting).
        self._takes += 1
        waiting = self._rows[:1] if self._takes == 1 else [] if self._takes == 2 else self._rows
        taken = [r for r in waiting if engine.bucket_length(len(r.ids), 32) == bucket][:count]
        self._rows = [r for r in self._rows if r not in taken]
        return taken


def test_beam_search_and_scores_match_the_whole_batch_functions(tiny):
    model, params, _, _, rows = tiny
    settings = decoding_settings.DecodingSettings(num_beams=3)
    got = _engine(tiny, batch_size=4).generate(rows[:3], engine.Request(settings, MAX_LENGTH))
    tokens = slot_batch.padded(rows[:3], 3, 32)
    expected = np.asarray(
        reference_decoding.predict(model, params, tokens, MAX_LENGTH, None, settings)
    )
    np.testing.assert_array_equal(np.stack(got), expected)
    targets = [(5, 6, EOS), (7, EOS), (8, 9, 10, EOS)]
    scores = _engine(tiny, batch_size=2).score(rows[:3], targets)
    target_ids = slot_batch.padded(targets, 3, 16)
    batch = {
        "encoder_input_tokens": tokens,
        "decoder_input_tokens": np.pad(target_ids, ((0, 0), (1, 0)))[:, :-1],
        "decoder_target_tokens": target_ids,
    }
    np.testing.assert_allclose(scores, np.asarray(model.score(params, batch)), rtol=1e-5)


def test_buckets_and_row_counts():
    assert [engine.bucket_length(n, 512) for n in (1, 16, 17, 100, 600)] == [16, 16, 32, 128, 512]
    assert engine.bucket_length(40, 24) == 24
    assert engine.slot_counts(32, 1) == (2, 8, 32)
    assert engine.slot_counts(64, 1) == (1, 4, 16, 64)
    assert engine.slot_counts(24, 1) == (1, 6, 24)
    assert engine.slot_counts(8, 4) == (4, 8)
    assert [slot_batch.insert_size(n) for n in (1, 2, 8, 32)] == [1, 1, 2, 8]


def test_a_known_lists_bucket_of_few_rows_joins_a_longer_one():
    """generate, score and eval know all their rows: a padded length that fewer than `fill` of
    them take compiles no programs of its own."""
    lengths = [3] * 5 + [20] * 10 + [40] * 3  # buckets 16, 32 and 64 (the longest)
    bucket = lambda n: engine.bucket_length(n, 64)  # noqa: E731
    for fill, expected in [(0, [16, 32, 64]), (8, [32, 32, 64]), (16, [64, 64, 64])]:
        fitted = engine.fitted_buckets(bucket, lengths, fill=fill)
        assert [fitted(n) for n in (3, 20, 40)] == expected, fill


def test_warm_up_compiles_the_documented_programs_and_decoding_compiles_none(tiny):
    server = _engine(tiny, batch_size=8, smaller_batches=True)
    request = engine.Request(decoding_settings.DecodingSettings(), MAX_LENGTH)
    # 2 row counts (2, 8) x 2 input buckets (16, 32) x (insert, segment).
    assert server.warm_up(request) == server.programs_needed(request) == 8
    before = compile_events.lowered()
    first = server.generate(tiny[4], request)
    again = server.generate(tiny[4], request)  # on the states the first call left
    assert compile_events.lowered() == before
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)


def test_any_temperature_top_k_and_top_p_sample_with_one_set_of_programs(tiny):
    """Sampling's values are the programs' inputs (each slot's own): new values compile
    nothing, and they take effect (top_k 1 is greedy whatever the temperature)."""
    server, rows = _engine(tiny, batch_size=4), tiny[4]
    sample = engine.Request(decoding_settings.DecodingSettings(temperature=1.0, seed=1), MAX_LENGTH)
    first = server.generate(rows, sample)
    programs, lowered = server.program_count, compile_events.lowered()
    others = [
        decoding_settings.DecodingSettings(temperature=0.3, top_k=5, seed=1),
        decoding_settings.DecodingSettings(temperature=2.0, top_p=0.5, seed=1),
        decoding_settings.DecodingSettings(temperature=1.5, top_k=1, top_p=0.8, seed=9),
    ]
    outputs = [server.generate(rows, engine.Request(s, MAX_LENGTH)) for s in others]
    assert (server.program_count, compile_events.lowered()) == (programs, lowered)
    assert not all(np.array_equal(a, b) for a, b in zip(first, outputs[1], strict=True))
    greedy = server.generate(rows, engine.Request(decoding_settings.DecodingSettings(), MAX_LENGTH))
    for a, b in zip(outputs[2], greedy, strict=True):
        np.testing.assert_array_equal(a, b)


def test_rows_are_seen_as_they_decode_and_a_row_whose_caller_left_frees_its_slot(tiny):
    """stream(partial=...) yields each row's ids so far after every segment, each a prefix of
    its answer; stream(left=...) takes a row out of its slot at the next segment boundary,
    and the rows beside it answer as they would have anyway. Neither compiles anything."""
    rows = tiny[4]
    server = _engine(tiny, batch_size=4, smaller_batches=True)
    request = engine.Request(decoding_settings.DecodingSettings(), MAX_LENGTH)
    want = server.generate(rows, request)
    programs = server.program_count
    long = [i for i, ids in enumerate(want) if _length(ids) > 6]
    leaving = set(long[:2])
    assert len(leaving) == 2, [_length(ids) for ids in want]
    seen: dict[int, list] = {i: [] for i in range(len(rows))}
    got: dict[str, dict] = {"finished": {}, "left": {}}
    feed = engine.ListFeed(
        (engine.Row(tuple(ids), i, tag=i) for i, ids in enumerate(rows)),
        bucket=server.bucket,
        fill=server.few_rows,  # as generate's: the same shapes
    )
    for decoded in server.stream(
        feed,
        request,
        poll_steps=2,
        partial=lambda row: True,
        left=lambda row: row.tag in leaving and len(seen[row.tag]) >= 1,
    ):
        if decoded.state == "decoding":
            seen[decoded.row.tag].append(decoded.ids.copy())
        else:
            got[decoded.state][decoded.row.tag] = decoded.ids
    assert set(got["left"]) == leaving
    assert set(got["finished"]) == set(range(len(rows))) - leaving
    for index, ids in got["finished"].items():
        np.testing.assert_array_equal(ids, want[index])
    for index, partials in seen.items():
        written = [int(np.count_nonzero(ids)) for ids in partials]
        assert written == sorted(written), index  # each segment adds to the last
        for ids in partials:
            assert np.all((ids == want[index]) | (ids == 0)), index
    assert sum(len(p) for p in seen.values()) > len(rows)  # rows were seen mid-way
    assert server.program_count == programs
