"""Checks, before any work, that what a run reads is there: the files a task's source lists, and
a tfds data set that is prepared or can be (process 0 prepares it first on several hosts).
Buckets of gs:// paths are storage.remote's."""

from __future__ import annotations

import os
import socket
import urllib.parse

import jax
from jax.experimental import multihost_utils

from t5tpu.errors import UserError, one_line_message
from t5tpu.runtime.lazy_imports import seqio, tf

TFDS_GCS_HOST = "storage.googleapis.com"  # tfds' mirror of prepared data sets


def check_readable(name: str, split: str, setting: str | None = None) -> None:
    """Refuses, in one line, a split whose data is not there: files a task's source lists that
    do not exist, or a tfds data set neither prepared nor downloadable. Unchecked, seqio fails
    deep inside tf.data (a file pattern matching nothing is a bare ValueError, a failed tfds
    download a requests traceback). Tasks of a mixture that lack the split are the caller's
    concern: eval skips them, infer refuses mixtures. `setting`: the macro that chose `split`."""
    task = seqio.get_mixture_or_task(name)
    for each in task.tasks if isinstance(task, seqio.Mixture) else [task]:
        if split not in each.splits:
            continue
        cannot = f"cannot read the {split!r} split of task {each.name!r}"
        missing = _missing_files(each.source, split)
        if missing:
            instead = f" or set {setting} to another split" if setting else ""
            raise UserError(f"{cannot} ({missing}); restore its data{instead}")
        why = _tfds_unavailable(each.source)
        if why:
            raise UserError(f"{cannot}: {why}")


def _missing_files(source: seqio.DataSource, split: str) -> str | None:
    if not isinstance(source, seqio.FileDataSource):
        return None
    files = source.list_shards(split)  # a pattern without wildcards is listed as it is
    if not files:
        return "no file matches its file pattern"
    missing = [path for path in files if not tf.io.gfile.exists(path)]
    return f"no file {missing[0]}" if missing else None


def _tfds_unavailable(source: seqio.DataSource) -> str | None:
    """None once the tfds data set is prepared, downloading and preparing it on first use.
    Hosts take turns: process 0 first, so hosts sharing a data_dir (gs://) prepare it once
    instead of racing to write it; with local data_dirs each host then prepares its own."""
    if not isinstance(source, seqio.TfdsDataSource):
        return None
    builder = source.tfds_dataset.builder
    first = jax.process_index() == 0
    why = _prepared_or_why_not(builder) if first else None
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"t5tpu: tfds {builder.info.full_name} prepared")
    return why if first else _prepared_or_why_not(builder)


def _prepared_or_why_not(builder) -> str | None:
    if builder.is_prepared():
        if not builder.info.splits:  # another host prepared it after this builder was made
            builder.info.read_from_directory(builder.data_dir)
        return None
    hosts = _unresolvable_download_hosts(builder)
    if hosts:
        return _cannot_prepare(builder, f"no network: cannot resolve {', '.join(hosts)}")
    print(f"preparing tfds {builder.info.full_name} in {builder.data_dir} (first use)", flush=True)
    try:
        builder.download_and_prepare()
    except Exception as e:  # the download's own error says why; no traceback for a user's setup
        return _cannot_prepare(builder, f"{type(e).__name__}: {one_line_message(e)[:200]}")
    return None


def _unresolvable_download_hosts(builder) -> list[str]:
    """The hosts a tfds download would use (its URLs, and the GCS mirror tfds tries first) when
    none of them resolves, else []: offline, tfds retries each URL for minutes before failing.
    Behind a proxy the names need not resolve here, so nothing is probed."""
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY")):
        return []
    urls = list(builder.url_infos or {})
    if not urls:
        return []
    hosts = sorted({urllib.parse.urlparse(url).hostname for url in urls} | {TFDS_GCS_HOST})
    for host in hosts:
        try:
            socket.getaddrinfo(host, 443)
            return []
        except OSError:
            continue
    return hosts


def _cannot_prepare(builder, cause: str) -> str:
    return (
        f"tfds {builder.info.full_name} is not prepared in {builder.data_dir} and preparing "
        f"it failed ({cause}); prepare it on a machine with internet and point the task's "
        "tfds data_dir at it, or bind the task's own files in gin (docs/USAGE.md: Tasks and "
        "data)"
    )
