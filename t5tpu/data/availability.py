"""Checks, before any work, that what a run reads is there: the files a task's source lists, and
a tfds data set that is prepared or can be (process 0 prepares it first on several hosts).
Buckets of gs:// paths are storage.remote's."""

from __future__ import annotations

import glob
import os
import re
import socket
import urllib.parse

import jax
from etils import epath
from jax.experimental import multihost_utils

from t5tpu.errors import UserError, one_line_message
from t5tpu.runtime.lazy_imports import seqio, tf
from t5tpu.storage import remote, user_files

TFDS_GCS_HOST = "storage.googleapis.com"  # tfds' mirror of prepared data sets
# TFRecords of at most this many bytes per split are read whole before a run to find damage;
# larger data is checked as it is read.
SCANNED_BYTES = 256 << 20
# A file source with this attribute set says its num_input_examples are the exact record counts.
EXACT_SIZES = "t5tpu_exact_sizes"
# A source attribute: the gin binding of a tfds source's data_dir, named when it is not ready.
DATA_DIR_BINDING = "t5tpu_data_dir_binding"
TFDS_SETTING = "tfds data_dir"  # in messages about a tfds data set's directory


def check_readable(name: str, split: str, setting: str | None = None) -> None:
    """Refuses, in one line, a split whose data is not there: files a task's source lists that
    do not exist or (TFRecords of seqio.TFExampleDataSource, up to SCANNED_BYTES) are damaged,
    or a tfds data set neither prepared nor downloadable. Unchecked, seqio fails deep inside
    tf.data (a file pattern matching nothing is a bare ValueError, a damaged record a
    DataLossError, a failed tfds download a requests traceback). gs:// files are asked through
    the storage layer (storage.remote), within the storage answer time, before TensorFlow's own
    client touches them. Tasks of a mixture that lack the split are the caller's concern: eval
    skips them, infer refuses mixtures. `setting`: the macro that chose `split`."""
    task = seqio.get_mixture_or_task(name)
    for each in task.tasks if isinstance(task, seqio.Mixture) else [task]:
        if split not in each.splits:
            continue
        cannot = f"cannot read the {split!r} split of task {each.name!r}"
        problem = _files_problem(each.source, split, f"task {each.name!r} {split} file")
        if problem:
            instead = f" or set {setting} to another split" if setting else ""
            raise UserError(f"{cannot} ({problem}); restore its data{instead}")
        why = _tfds_unavailable(each.source)
        if why:
            raise UserError(f"{cannot}: {why}")


def _files_problem(source: seqio.DataSource, split: str, setting: str) -> str | None:
    """What is wrong with the files of a file source's split (a missing or damaged one), else
    None; `setting` names them in the storage layer's own messages."""
    if not isinstance(source, seqio.FileDataSource):
        return None
    files = _listed_files(source, split, setting)
    if not files:
        return f"no file matches {', '.join(_patterns(source, split))}"
    missing = [path for path in files if not remote.is_file(path, setting)]
    if missing:
        return f"no file {missing[0]}"
    if (
        isinstance(source, seqio.TFExampleDataSource)
        and source.reader_cls is tf.data.TFRecordDataset
    ):
        return _damaged_records(source, split, files, setting)
    return None


def _listed_files(source: seqio.FileDataSource, split: str, setting: str) -> list[str]:
    """The files of a split, as seqio lists them (FileDataSource.list_shards), but with the
    wildcards expanded through epath: seqio's tf.io.gfile.glob would be TensorFlow's client."""
    files = []
    for pattern in _patterns(source, split):
        if not glob.has_magic(pattern):
            files.append(pattern)
            continue
        remote.check_storage(pattern, setting)
        files += remote.answered(lambda p=pattern: _glob(p), path=pattern, setting=setting)
    return files


def _patterns(source: seqio.FileDataSource, split: str) -> list[str]:
    patterns = source._split_to_filepattern[split]  # seqio 0.0.20 keeps no public copy
    return [patterns] if isinstance(patterns, str) else list(patterns)


def described_files(name: str, split: str) -> str:
    """The file patterns of a task's (or mixture's) file sources for `split`, for messages."""
    task = seqio.get_mixture_or_task(name)
    tasks = task.tasks if isinstance(task, seqio.Mixture) else [task]
    return ", ".join(
        pattern
        for each in tasks
        if isinstance(each.source, seqio.FileDataSource) and split in each.splits
        for pattern in _patterns(each.source, split)
    )


def _glob(pattern: str) -> list[str]:
    parts = pattern.split("/")
    first = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    root = epath.Path("/".join(parts[:first]) or ".")
    return sorted(str(path) for path in root.glob("/".join(parts[first:])))


def _damaged_records(source: seqio.TFExampleDataSource, split: str, files: list[str], setting):
    """Which TFRecord file is cut short or damaged, read whole with the task's own parsing;
    skipped when the files are larger than SCANNED_BYTES together (there the training input
    reports a damaged record as it meets it, pipeline.InputStream). A source whose sizes are
    exact (EXACT_SIZES: prepare-quora's counts) must hold that many records."""
    sizes = [user_files.size(path, what=setting) for path in files]
    if sum(sizes) > SCANNED_BYTES:
        return None
    records = 0
    for path, size in zip(files, sizes, strict=True):
        try:
            count, read = _tfrecords_read(path, source.feature_description)
        except (tf.errors.DataLossError, tf.errors.InvalidArgumentError) as e:
            return f"{path} is damaged: {tensorflow_message(e)}"
        except tf.errors.OpError as e:  # storage, not the file: TensorFlow's client's words
            return f"TensorFlow cannot read {path}: {tensorflow_message(e)}"
        if read != size:
            return f"{path} is damaged: cut short, {size - read} bytes after its last whole record"
        records += count
    expected = source.num_input_examples(split) if getattr(source, EXACT_SIZES, False) else None
    if expected is not None and records != expected:
        holds = "holds" if len(files) == 1 else "hold"
        return f"{', '.join(files)} {holds} {records} records where {expected} were written"
    return None


def _tfrecords_read(path: str, feature_description) -> tuple[int, int]:
    """(records, bytes of those whole records) of a TFRecord file, every record parsed as the
    task's source parses it. TensorFlow checks each record's checksums, but reads a file that
    ends inside a record's header as if it ended before it: the bytes against the size find
    that."""
    framing = 16  # length (8), its CRC (4), the data's CRC (4)

    def parsed(records):
        examples = tf.io.parse_example(records, feature_description)
        # The values counted too: a result left unused would be pruned, and its parsing with it.
        values = [tf.size(t, out_type=tf.int64) for t in tf.nest.flatten(examples, True)]
        lengths = tf.cast(tf.strings.length(records) + framing, tf.int64)
        count = tf.size(records, out_type=tf.int64)
        return tf.stack([count, tf.reduce_sum(lengths), sum(values, tf.constant(0, tf.int64))])

    batches = tf.data.TFRecordDataset(path).batch(1024).map(parsed)
    totals = batches.reduce(tf.zeros([3], tf.int64), lambda total, n: total + n)
    count, read, _ = totals.numpy()
    return int(count), int(read)


def tensorflow_message(error: Exception) -> str:
    """A TensorFlow error's own words, without its op's name and graph node: one short line."""
    message = str(getattr(error, "message", error)).strip().splitlines()[0] if str(error) else ""
    message = re.sub(r"^\{\{[^}]*\}\}\s*", "", message)
    message = re.sub(r"\s*\[Op:[^\]]*\].*$", "", message)
    message = re.sub(r"^Error in user-defined function .* with iterator: \S+: ", "", message)
    return message[:200] or type(error).__name__


def _tfds_unavailable(source: seqio.DataSource) -> str | None:
    """None once the tfds data set is prepared, downloading and preparing it on first use.
    Hosts take turns: process 0 first, so hosts sharing a data_dir (gs://) prepare it once
    instead of racing to write it; with local data_dirs each host then prepares its own."""
    if not isinstance(source, seqio.TfdsDataSource):
        return None
    # A gs:// data_dir's bucket is asked through the storage layer before tfds reads it (with
    # TensorFlow's client unless EPATH_USE_TF=false).
    data_dir = source.tfds_dataset.data_dir or os.environ.get("TFDS_DATA_DIR")
    remote.check_storage(data_dir, TFDS_SETTING)
    builder = source.tfds_dataset.builder
    first = jax.process_index() == 0
    why = _prepared_or_why_not(builder, source) if first else None
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"t5tpu: tfds {builder.info.full_name} prepared")
    return why if first else _prepared_or_why_not(builder, source)


def _prepared_or_why_not(builder, source) -> str | None:
    prepared = remote.answered(
        builder.is_prepared, path=str(builder.data_dir), setting=TFDS_SETTING
    )
    if prepared:
        if not builder.info.splits:  # another host prepared it after this builder was made
            builder.info.read_from_directory(builder.data_dir)
        return None
    hosts = _unresolvable_download_hosts(builder)
    binding = getattr(source, DATA_DIR_BINDING, "the task's tfds data_dir")
    if hosts:
        return _cannot_prepare(builder, binding, f"no network: cannot resolve {', '.join(hosts)}")
    print(f"preparing tfds {builder.info.full_name} in {builder.data_dir} (first use)", flush=True)
    try:
        builder.download_and_prepare()
    except Exception as e:  # the download's own error says why; no traceback for a user's setup
        cause = f"{type(e).__name__}: {one_line_message(e)[:200]}"
        return _cannot_prepare(builder, binding, cause)
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


def _cannot_prepare(builder, binding: str, cause: str) -> str:
    return (
        f"tfds {builder.info.full_name} is not prepared in {builder.data_dir} and preparing "
        f"it failed ({cause}); prepare it on a machine with internet and bind {binding} to "
        "its folder, or bind the task's own files in gin (docs/USAGE.md: Tasks and data)"
    )
