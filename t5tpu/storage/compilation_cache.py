"""JAX's persistent compilation cache: where t5tpu keeps it and how it is turned on.

Compiled programs are written to disk, so a second `t5tpu infer` (or a restarted training run)
loads them instead of compiling again. The cache lives in the user's cache directory, not in
MODEL_DIR: programs are keyed by what they compute, so runs in different MODEL_DIRs share them,
and a gs:// MODEL_DIR would make every lookup a network round trip.

T5TPU_COMPILATION_CACHE names another directory, or turns the cache off ('off'). JAX's own
JAX_COMPILATION_CACHE_DIR (or a cache directory already set in jax.config) wins, with JAX's own
settings left as they are. A cache directory that cannot be written (read-only, a file in its
place, a disk with less than MIN_FREE_BYTES free) never fails a run: it is skipped with one
warning. At every start the cache is trimmed to MAX_BYTES, least recently used programs first,
and entries left empty by a disk that filled up are removed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

from t5tpu.storage import locations

ENV = "T5TPU_COMPILATION_CACHE"
# JAX keeps every program forever: this bounds the disk the cache takes, with room for many
# models' programs on TPU (sizes seen on CPU: docs/PERFORMANCE.md).
MAX_BYTES = 2 * 2**30
_OFF = frozenset({"off", "none", "0", "false", "no"})
# JAX writes an entry in place and never replaces one that exists: on a disk that fills up it
# leaves an empty or cut entry behind, then a warning for each program, so a nearly full disk
# is skipped up front. A tiny model's programs are kilobytes, a large one's tens of megabytes.
MIN_FREE_BYTES = 64 << 20


def default_directory() -> str:
    """$XDG_CACHE_HOME/t5tpu/jax, ~/.cache/t5tpu/jax without it."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "t5tpu", "jax")


def directory() -> str | None:
    """The directory T5TPU_COMPILATION_CACHE names (else the default); None when it is off."""
    chosen = os.environ.get(ENV, "").strip()
    if chosen.lower() in _OFF:
        return None
    return os.path.expanduser(chosen) if chosen else default_directory()


def _unwritable(path: str) -> str | None:
    """Why no cache entry can be written under `path`, or None when one can. Remote paths
    (gs://) are JAX's to reach; asking the bucket here would cost a round trip every start."""
    if locations.is_remote(path):
        return None
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
        stat = os.statvfs(path)
    except OSError as e:
        return e.strerror or type(e).__name__
    free = stat.f_bavail * stat.f_frsize
    if free < MIN_FREE_BYTES:
        return f"{free / 2**20:.1f} MiB free, less than {MIN_FREE_BYTES >> 20} MiB"
    return None


def enable() -> str | None:
    """Turns the cache on for this process; returns its directory, or None when it is off or
    cannot be written. Call it before the first compile: JAX opens the cache once."""
    import jax

    if jax.config.jax_compilation_cache_dir:  # JAX_COMPILATION_CACHE_DIR, or the caller's own
        return jax.config.jax_compilation_cache_dir
    path = directory()
    if path is None:
        return None
    why = _unwritable(path)
    if why:
        # Read-only home, full disk: the run is fine without it, only slower to start.
        print(
            f"t5tpu: warning: compilation cache {path} cannot be written ({why}); compiling "
            f"without it (set {ENV} to a writable directory, or to 'off')",
            file=sys.stderr,
            flush=True,
        )
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    # JAX keeps only programs that took a second or more to compile; a small model's programs
    # (decoding, the random-key set-up, restore's helpers) compile faster than that, and
    # together they are most of a second call's start.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    trim(path)
    return path


def trim(path: str, max_bytes: int | None = None) -> int:
    """Deletes the least recently used files of the cache at `path` (by their access times, or
    their write times where the file system keeps none) until it holds at most `max_bytes`
    (MAX_BYTES by default); returns how many went. A listing and a stat per program, cheap
    enough for every start. Not JAX's own size limit (jax_compilation_cache_max_size): that
    one keeps a last-use file per program, locks the directory for every lookup, and fails to
    write new programs beside ones cached without it, as every cache made before would be.
    Empty entries (a write cut short by a full disk, which JAX would never redo) go first."""
    max_bytes = MAX_BYTES if max_bytes is None else max_bytes
    if locations.is_remote(path):
        return 0
    entries = []
    with os.scandir(path) as listing:
        for entry in listing:
            with contextlib.suppress(OSError):
                if entry.is_file():
                    stat = entry.stat()
                    entries.append((max(stat.st_atime, stat.st_mtime), stat.st_size, entry.path))
    total = sum(size for _, size, _ in entries)
    removed = 0
    # Empty entries first (key 0), then the least recently used.
    for _, size, file in sorted(entries, key=lambda e: (e[1] > 0, e[0])):
        if total <= max_bytes and size:
            break
        with contextlib.suppress(OSError):  # another process's trim took it first
            os.remove(file)
            removed += 1
        total -= size
    return removed
