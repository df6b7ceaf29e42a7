"""seqio glue: task lookup, a check that a split's data is there, per-host training streams,
fixed-shape batches, global arrays.

On several hosts each one reads only its shard of the training data (seqio's ShardInfo) and
holds only its rows of each global batch; `to_global` puts those rows on this host's devices.
Evaluation and inference read every example on every host and place the full batch with
`full_batch_to_global`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import socket
import sys
import urllib.parse
from collections.abc import Iterator, Mapping

import jax
import numpy as np
import seqio
import tensorflow as tf
from jax.experimental import multihost_utils

from t5tpu.errors import UserError, one_line_message
from t5tpu.partitioning import DataLayout, host_data_rows

TFDS_GCS_HOST = "storage.googleapis.com"  # tfds' mirror of prepared data sets


def import_task_module(module: str) -> None:
    """Imports a user module that registers seqio tasks: a dotted module name or a .py path."""
    if module.endswith(".py"):
        if not os.path.exists(module):
            raise UserError(f"task module file not found: {module}; fix MIXTURE_OR_TASK_MODULE")
        spec = importlib.util.spec_from_file_location(os.path.basename(module)[:-3], module)
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        return
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise UserError(
            f"cannot import task module {module!r} ({e}); set MIXTURE_OR_TASK_MODULE to an "
            "importable module or a .py file that registers your seqio tasks"
        ) from None


def get_task(name: str, module: str | None = None) -> seqio.Task | seqio.Mixture:
    """The registered task or mixture `name`, after registering t5tpu's own and `module`'s."""
    from t5tpu import tasks  # registers with the gin-bound vocabulary, so only after parsing

    tasks.register_builtin_tasks()
    if module:
        import_task_module(module)
    known = ", ".join(sorted(set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names())))
    # None when an experiment leaves it unset: infer.gin's default (inference needs no task
    # when given texts), included after finetune.gin and eval.gin, replaces their REQUIRED.
    if not name:
        raise UserError(f"MIXTURE_OR_TASK_NAME is not set; set it to one of: {known}")
    try:
        return seqio.get_mixture_or_task(name)
    except ValueError:
        raise UserError(
            f"unknown task or mixture {name!r}; known: {known}. Set MIXTURE_OR_TASK_NAME, and "
            "MIXTURE_OR_TASK_MODULE to the module that registers it"
        ) from None


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
        "tfds data_dir at it, or bind the task's own files in gin (README: Tasks and data)"
    )


def feature_converter(pack: bool) -> seqio.FeatureConverter:
    return seqio.EncDecFeatureConverter(pack=pack)


def model_lengths(task_feature_lengths: Mapping[str, int]) -> tuple[int, int]:
    """(encoder length, decoder length) from {'inputs': n, 'targets': m}."""
    try:
        return int(task_feature_lengths["inputs"]), int(task_feature_lengths["targets"])
    except (KeyError, TypeError):
        raise UserError(
            f"TASK_FEATURE_LENGTHS={task_feature_lengths!r}; bind it as "
            "{'inputs': 512, 'targets': 128}"
        ) from None


def train_batches(
    task_name: str,
    task_feature_lengths: Mapping[str, int],
    batch_size: int,
    seed: int,
    pack: bool,
    split: str = "train",
    skip_batches: int = 0,
    layout: DataLayout | None = None,
    saved_position: str | None = None,
) -> InputStream:
    """An endless, deterministic stream of this host's share of each global batch.

    The order is fixed by `seed`. A resumed run continues where the stream stood when its
    checkpoint was saved: from `saved_position` (InputStream.save) if that was written for this
    pipeline, else by reading and dropping the `skip_batches` batches already used; either way
    it sees exactly the examples an uninterrupted run would. Resumed with other settings (a
    position of another pipeline), it skips as many batches of the new shape, with a warning:
    where a run that always had those settings would stand. `layout`
    (Partitioner.data_layout(batch_size)) says which shard this host reads; without it every
    host reads its own shard, which is right unless the 'model' axis spans hosts.
    """
    if layout is None:
        num_hosts = jax.process_count()
        if batch_size % num_hosts:
            raise UserError(f"BATCH_SIZE={batch_size} must be a multiple of the {num_hosts} hosts")
        layout = DataLayout(jax.process_index(), num_hosts, batch_size // num_hosts)
    # A position only fits the pipeline that saved it: a run resumed with another batch size,
    # task or host layout must not get the old pipeline's buffered batches.
    settings = (task_name, sorted(task_feature_lengths.items()), seed, pack, split, layout)
    pipeline = hashlib.sha256(repr(settings).encode()).hexdigest()[:12]

    def stream():
        ds = seqio.get_dataset(
            task_name,
            task_feature_lengths,
            feature_converter(pack),
            dataset_split=split,
            shuffle=True,
            num_epochs=None,
            seed=seed,
            use_cached=False,
            verbose=False,
            shard_info=seqio.ShardInfo(index=layout.shard_index, num_shards=layout.num_shards),
        )
        ds = ds.batch(layout.local_batch_size, drop_remainder=True)
        return InputStream(ds.prefetch(tf.data.AUTOTUNE), pipeline)

    if saved_position and tf.io.gfile.exists(f"{saved_position}.{pipeline}.index"):
        restored = stream()
        try:
            restored.restore(saved_position)
            return restored
        # A lost, truncated or foreign file raises many kinds of errors; skipping is always right.
        except Exception as e:
            print(
                f"t5tpu: warning: input position {saved_position} does not fit this pipeline "
                f"({one_line_message(e)[:200]}); skipping {skip_batches} batches instead",
                file=sys.stderr,
            )
    elif saved_position and tf.io.gfile.glob(f"{saved_position}.*.index"):
        print(
            f"t5tpu: warning: {saved_position} was saved by another input pipeline (batch size, "
            f"task, lengths, seed, packing or hosts changed); skipping {skip_batches} batches of "
            "the new shape, as if the run had always used it",
            file=sys.stderr,
        )
    skipped = stream()
    skipped.skip(skip_batches)
    return skipped


class InputStream:
    """An iterator of numpy batches whose position can be saved beside a checkpoint: restoring
    it costs a fraction of a second, where skipping runs every skipped example through the
    pipeline again (minutes at step 20,000 of a batch-256 recipe)."""

    def __init__(self, ds: tf.data.Dataset, pipeline: str):
        self._iterator = iter(ds)
        self._pipeline = pipeline  # names the saved files: a fingerprint of the settings

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return {name: value.numpy() for name, value in next(self._iterator).items()}

    def skip(self, batches: int) -> None:
        for _ in range(batches):
            next(self._iterator)

    def save(self, prefix: str) -> None:
        """Writes the position (the shuffle and prefetch buffers included) to `prefix`.*."""
        tf.train.Checkpoint(input=self._iterator).write(f"{prefix}.{self._pipeline}")

    def restore(self, prefix: str) -> None:
        checkpoint = tf.train.Checkpoint(input=self._iterator)
        checkpoint.read(f"{prefix}.{self._pipeline}").assert_consumed()


def examples_in(batch: Mapping[str, np.ndarray]) -> int:
    """Examples in a host batch: one per row, or, when packed, one per segment (a segment starts
    where its decoder position is 0)."""
    if "decoder_segment_ids" not in batch:
        return len(batch["decoder_target_tokens"])
    starts = (batch["decoder_positions"] == 0) & (batch["decoder_segment_ids"] > 0)
    return int(starts.sum())


def to_global(batch: Mapping[str, np.ndarray], sharding: jax.sharding.NamedSharding) -> dict:
    """This host's rows of a global batch -> global arrays sharded over the mesh's 'data' axis.

    The host's devices hold some rows (data shards) of the global batch, not necessarily
    adjacent ones (on a TPU pod the mesh follows the physical torus); jax fills them with the
    local rows in order. Which example lands in which global row does not matter to a step."""
    host_shards = len(host_data_rows(sharding)[jax.process_index()])
    scale = sharding.mesh.shape["data"] / host_shards  # global rows per local row
    placed = {}
    for name, local in batch.items():
        local = np.asarray(local)
        global_shape = (round(local.shape[0] * scale),) + local.shape[1:]
        placed[name] = jax.make_array_from_process_local_data(sharding, local, global_shape)
    return placed


def full_batch_to_global(batch: Mapping[str, np.ndarray], sharding: jax.sharding.Sharding) -> dict:
    """A batch that every host holds in full (evaluation, inference) -> global arrays."""
    return {
        k: jax.make_array_from_process_local_data(sharding, np.asarray(v), np.shape(v))
        for k, v in batch.items()
    }


def padded_batches(ds: tf.data.Dataset, batch_size: int) -> Iterator[tuple[np.ndarray, dict]]:
    """Batches of an enumerated, finite dataset of (index, features), zero-padded to a fixed size
    so one compiled function serves them all. Yields (indices of the real rows, features)."""
    for indices, features in ds.batch(batch_size).as_numpy_iterator():
        missing = batch_size - len(indices)
        if missing:
            features = {
                k: np.concatenate([v, np.zeros((missing,) + v.shape[1:], v.dtype)])
                for k, v in features.items()
            }
        yield indices, features
