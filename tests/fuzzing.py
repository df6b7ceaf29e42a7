"""Fuzzing of every reader of the user's bytes (hypothesis), shared by the fuzz suites.

`damaged(valid, boundaries)` makes files from one valid file: random bytes, the empty file,
cuts at each structural boundary and anywhere, bit flips, and length fields overwritten with
values far beyond the file. `assert_refused(read)` runs one reader on one of them: it may read
the file (a flipped bit in an array's data is still a file) or refuse it with one UserError of
one line; anything else (a traceback's exception, a MemoryError, a hang, a giant allocation)
fails the test. Cases are derandomized, so CI runs the same ones every time; their number is
FUZZ_EXAMPLES (T5TPU_FUZZ_EXAMPLES overrides it for a longer local hunt).
"""

from __future__ import annotations

import os
import resource
import struct
import time
import tracemalloc

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from t5tpu.errors import UserError

FUZZ_EXAMPLES = int(os.environ.get("T5TPU_FUZZ_EXAMPLES", "40"))
# Settings for every fuzz test: the same cases on every run, no example database written into
# the checkout, and no deadline per case (the bound is assert_refused's, over the whole read).
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# A reader of a damaged file of a few kilobytes needs neither much time nor much memory.
MAX_SECONDS = 10.0
MAX_MIB = 64


def _flip(valid: bytes, positions: list[int]) -> bytes:
    data = bytearray(valid)
    for position in positions:
        data[position % len(data)] ^= 1 << (position % 8)
    return bytes(data)


def _huge_length(valid: bytes, at: int, width: int, big_endian: bool) -> bytes:
    """`valid` with the `width`-byte integer at `at` replaced by a length far beyond the file."""
    at = min(at, max(len(valid) - width, 0))
    fmt = (">" if big_endian else "<") + {1: "B", 2: "H", 4: "I", 8: "Q"}[width]
    huge = (1 << (8 * width)) - 1 - (at % 7)
    return valid[:at] + struct.pack(fmt, huge) + valid[at + width :]


def damaged(valid: bytes, boundaries: list[int] = ()) -> st.SearchStrategy[bytes]:
    """Damaged versions of the file `valid`; `boundaries` are offsets where its structure
    changes (after a header, between records), where a cut is most telling."""
    cuts = sorted({0, len(valid), *(b for b in boundaries if 0 <= b <= len(valid))})
    strategies = [
        st.binary(max_size=512),
        st.sampled_from(cuts).map(lambda n: valid[:n]),
        st.integers(0, max(len(valid) - 1, 0)).map(lambda n: valid[:n]),
    ]
    if valid:
        strategies += [
            st.lists(st.integers(0, 8 * len(valid)), min_size=1, max_size=4).map(
                lambda positions: _flip(valid, positions)
            ),
            st.builds(
                _huge_length,
                st.just(valid),
                st.sampled_from(cuts) | st.integers(0, len(valid)),
                st.sampled_from([1, 2, 4, 8]),
                st.booleans(),
            ),
        ]
    return st.one_of(strategies)


class _ResidentPeak:
    """tracemalloc's three calls, measured as the growth of the process's peak resident size:
    CPython 3.11's tracemalloc crashes the process (a segmentation fault) when it is stopped
    while other threads allocate, as orbax's worker threads do after a restore returns."""

    base = 0

    @staticmethod
    def _peak() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    @classmethod
    def start(cls) -> None:
        cls.base = cls._peak()

    @staticmethod
    def stop() -> None:
        pass

    @classmethod
    def get_traced_memory(cls) -> tuple[int, int]:
        return 0, cls._peak() - cls.base


def assert_refused(
    read,
    *,
    max_seconds: float = MAX_SECONDS,
    max_mib: float = MAX_MIB,
    threaded: bool = False,
):
    """Runs `read()`: it returns, or raises UserError whose message is one line; within
    `max_seconds` and with at most `max_mib` of Python and numpy allocations at its peak
    (`threaded`: a reader whose threads outlive it, bounded by resident size instead).
    Returns what `read()` returned, or the UserError."""
    memory = _ResidentPeak if threaded else tracemalloc
    memory.start()
    start = time.monotonic()
    try:
        outcome = read()
    except UserError as e:
        outcome = e
        message = str(e)
        assert message and "\n" not in message.strip(), f"not one line: {message!r}"
    finally:
        seconds = time.monotonic() - start
        _, peak = memory.get_traced_memory()
        memory.stop()
    assert seconds <= max_seconds, f"took {seconds:.1f} s"
    assert peak <= max_mib * 2**20, f"allocated {peak / 2**20:.0f} MiB at its peak"
    return outcome
