"""Several hosts, simulated on localhost: two processes x 4 fake CPU devices joined by
jax.distributed (gloo collectives, jax's default for CPU), against one process with 8 devices.

Each host reads only its rows of every global batch (Partitioner.data_layout) and places them
with batches.to_global; the two-process run must train the tiny model to the same parameters as the
one-process run, and save them with orbax from both processes into one checkpoint that the
one-process run restores exactly.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
from cli_runs import (
    ROOT,
    TINY_EXPERIMENT,
    cli_command,
    free_port,
    run_together,
    succeeded,
)
from tiny import tiny_config

# Multi-process training runs, and the command line on two processes.
pytestmark = pytest.mark.slow

XLA_FAST = "--xla_backend_optimization_level=0"  # compile faster; memory and numerics unchanged
MESHES = (1, 2, 4, 8)  # model-parallel degrees: 8x1, 4x2, 2x4, 1x8
TRAIN_PARTITIONS = 2  # train on the 4x2 mesh: 'data' across processes, 'model' inside one
GLOBAL_BATCH = 16


def _env(devices: int) -> dict:
    return dict(
        os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {XLA_FAST}"
    )


def _run_workers(out_dir: str, processes: int, restore_from: str) -> list:
    port = free_port()
    this = os.path.abspath(__file__)
    return run_together(
        [
            [sys.executable, this, out_dir, str(processes), str(pid), str(port), restore_from]
            for pid in range(processes)
        ],
        env=_env(8 // processes),
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two processes, then one. Each writes layouts.json (layouts, losses) and params.npz; the
    two-process run also saves an orbax checkpoint, which the one-process run restores into
    restored.npz."""
    two = str(tmp_path_factory.mktemp("two_processes"))
    one = str(tmp_path_factory.mktemp("one_process"))
    for out, processes, restore_from in ((two, 2, "-"), (one, 1, two)):
        for run in _run_workers(out, processes, restore_from):
            assert run.returncode == 0, run.stderr[-3000:]

    def load(out):
        with open(os.path.join(out, "layouts.json")) as f:
            return json.load(f), dict(np.load(os.path.join(out, "params.npz")))

    return {
        2: load(two),
        1: load(one),
        "restored": dict(np.load(os.path.join(one, "restored.npz"))),
        "checkpoint_files": os.listdir(os.path.join(two, "checkpoint_2", "params")),
    }


def test_each_host_reads_its_own_rows(runs):
    layouts, _ = runs[2]
    for parts in MESHES:
        by_host = layouts[str(parts)]
        mesh = by_host["0"]["mesh"]
        assert mesh == {"data": 8 // parts, "model": parts}
        if parts < 8:  # 'data' spans both processes: each reads half the batch, its own shard
            assert [by_host[h]["layout"] for h in ("0", "1")] == [
                [0, 2, GLOBAL_BATCH // 2],
                [1, 2, GLOBAL_BATCH // 2],
            ]
        else:  # 1x8: the 'model' axis spans the processes, so both read the whole batch
            assert [by_host[h]["layout"] for h in ("0", "1")] == [[0, 1, GLOBAL_BATCH]] * 2
        # The global array holds exactly the global batch's rows, whichever host read them.
        for host in ("0", "1"):
            assert by_host[host]["global_rows_sorted_equal"] is True


def test_two_processes_train_to_the_parameters_of_one(runs):
    _, two = runs[2]
    _, one = runs[1]
    assert two.keys() == one.keys() and len(one) > 20
    start = runs[1][0]["initial_param_norm"]
    moved = runs[1][0]["param_change"]
    assert moved > 1e-3 * start  # training changed the parameters
    worst = max(float(np.abs(two[k] - one[k]).max()) for k in one)
    assert worst < 2e-5
    assert runs[2][0]["losses"] == pytest.approx(runs[1][0]["losses"], rel=1e-5)


def test_every_process_follows_the_same_new_checkpoints(runs):
    # Per process: how many steps after none and after step 2, then the steps themselves.
    assert runs[2][0]["followed_by_process"] == [[1, 0, 2], [1, 0, 2]]


def test_both_processes_write_one_checkpoint_that_one_process_restores(runs):
    # orbax: each process writes its own part of the checkpoint.
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(runs["checkpoint_files"])
    _, two = runs[2]
    restored = runs["restored"]
    assert restored.keys() == two.keys()
    assert all(np.array_equal(restored[k], two[k]) for k in two)


# ----- the worker: one process of a run ------------------------------------------------------


def _tiny_model():
    from t5tpu.data import vocab
    from t5tpu.model.encoder_decoder import EncoderDecoderModel

    config = tiny_config()
    return EncoderDecoderModel(config, vocab.default_vocabulary(vocab.bundled_vocabulary_file()))


def _cli_on_two_processes(command: str, model_dir: str, *flags: str) -> list[str]:
    """stdout of `t5tpu COMMAND` run as two processes of 2 fake devices, as off Cloud TPU."""
    port = free_port()
    runs = run_together(
        [
            cli_command(
                command,
                f"--coordinator_address=localhost:{port}",
                "--num_processes=2",
                f"--process_id={pid}",
                f"--gin.MODEL_DIR='{model_dir}'",
                f"--gin_file={TINY_EXPERIMENT}",
                *flags,
            )
            for pid in range(2)
        ],
        env=_env(2),
    )
    return [succeeded(run).stdout for run in runs]


def test_cli_on_two_processes_trains_evaluates_and_infers(tmp_path):
    model_dir = str(tmp_path)
    train = _cli_on_two_processes(
        "train", model_dir, "--gin.TRAIN_STEPS=10", "--gin.SAVE_PERIOD=10", "--gin.EVAL_PERIOD=10"
    )
    last_step = [
        next(ln for ln in out.splitlines() if ln.startswith("step 10/10")) for out in train
    ]
    assert last_step[0].split()[:3] == last_step[1].split()[:3]  # the same global loss
    assert all(" on 4 device(s)" in out for out in train)  # 2 fake devices a process
    assert "eval at step 10" in train[0] and "process 0 has the metrics" in train[1]
    with open(os.path.join(model_dir, "eval_metrics.json")) as f:
        # Process 0's metrics count every validation row once.
        assert json.load(f)["10"]["qp_is_duplicate"]["num_examples"] == 105

    infer = _cli_on_two_processes(
        "infer", model_dir, "--gin.INFER_INPUT_FILE='examples/questions.txt'"
    )
    assert "decoded 3 predictions; process 0 writes them" in infer[1]
    with open(os.path.join(ROOT, "examples", "questions.txt")) as f:
        questions = [line.strip() for line in f if line.strip()]
    with open(os.path.join(model_dir, "inference", "questions-10.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [row["input"] for row in rows] == questions


def _global_batch() -> dict:
    """The same global batch in every process and every run (random tokens, padded rows)."""
    rng = np.random.default_rng(0)
    targets = rng.integers(2, 1024, size=(GLOBAL_BATCH, 8)).astype(np.int32)
    targets[:, 6:] = 0
    inputs = rng.integers(2, 1024, size=(GLOBAL_BATCH, 16)).astype(np.int32)
    inputs[: GLOBAL_BATCH // 2, 12:] = 0
    return {
        "encoder_input_tokens": inputs,
        "decoder_input_tokens": np.concatenate(
            [np.zeros((GLOBAL_BATCH, 1), np.int32), targets[:, :-1]], 1
        ),
        "decoder_target_tokens": targets,
    }


def _host_rows(batch: dict, layout) -> dict:
    """This host's shard of the global batch: every num_shards-th row, from shard_index."""
    return {k: v[layout.shard_index :: layout.num_shards] for k, v in batch.items()}


def _check_layouts(batch) -> dict:
    import jax

    from t5tpu.data import batches
    from t5tpu.partitioning import Partitioner

    found = {}
    for parts in MESHES:
        partitioner = Partitioner(num_partitions=parts)
        layout = partitioner.data_layout(GLOBAL_BATCH)
        placed = batches.to_global(_host_rows(batch, layout), partitioner.batch_sharding())
        gathered = jax.jit(lambda x: x, out_shardings=partitioner.replicated())(
            placed["encoder_input_tokens"]
        )
        rows = np.asarray(gathered)
        expected = batch["encoder_input_tokens"]
        found[str(parts)] = {
            "mesh": dict(partitioner.mesh.shape),
            "layout": [layout.shard_index, layout.num_shards, layout.local_batch_size],
            "global_rows_sorted_equal": sorted(map(tuple, rows.tolist()))
            == sorted(map(tuple, expected.tolist())),
        }
    return found


def _train(batch, out_dir: str, restore_from: str) -> tuple[list[float], dict, float, float]:
    import jax

    from t5tpu.data import batches
    from t5tpu.partitioning import Partitioner
    from t5tpu.storage import checkpoints
    from t5tpu.training import optim, trainer

    model, optimizer = _tiny_model(), optim.adafactor(learning_rate=0.01)
    partitioner = Partitioner(num_partitions=TRAIN_PARTITIONS)
    abstract, shardings = trainer.state_shardings(model, optimizer, partitioner)
    init = jax.jit(
        lambda rng: trainer.initial_state(model, optimizer, rng, 16, 8), out_shardings=shardings
    )
    state = init(jax.random.PRNGKey(0))
    replicate = jax.jit(lambda t: t, out_shardings=partitioner.replicated())
    first = jax.tree_util.tree_leaves(jax.device_get(replicate(state.params)))
    step = trainer.compile_train_step(model, optimizer, shardings, partitioner)
    layout = partitioner.data_layout(GLOBAL_BATCH)
    placed = batches.to_global(_host_rows(batch, layout), partitioner.batch_sharding())
    losses = []
    for _ in range(2):
        state, metrics = step(state, placed, jax.random.PRNGKey(1))
        losses.append(float(metrics["loss"]))
    # Every process takes part in saving (orbax writes each process's shards).
    checkpoints.save(checkpoints.manager(out_dir), 2, state.params, state.opt_state)
    flat = _flat(jax.device_get(replicate(state.params)))
    if restore_from != "-":
        mngr = checkpoints.manager(restore_from, read_only=True)
        restored = checkpoints.restore_params(mngr, 2, abstract.params, shardings.params)
        restored = _flat(jax.device_get(replicate(restored)))
        np.savez(os.path.join(out_dir, "restored.npz"), **restored)
    last = list(flat.values())
    norm = float(np.sqrt(sum(float((a**2).sum()) for a in first)))
    change = float(
        np.sqrt(sum(float(((a - b) ** 2).sum()) for a, b in zip(first, last, strict=True)))
    )
    return losses, flat, norm, change


def _flat(tree) -> dict:
    import jax

    return {
        "/".join(k.key for k in path): np.asarray(v)
        for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _worker(out_dir: str, processes: int, process_id: int, port: int, restore_from: str) -> None:
    import jax
    from jax.experimental import multihost_utils

    from t5tpu.storage import checkpoints

    if processes > 1:
        jax.distributed.initialize(f"localhost:{port}", processes, process_id)
    assert jax.device_count() == 8
    batch = _global_batch()
    layouts = _check_layouts(batch)
    losses, params, norm, change = _train(batch, out_dir, restore_from)
    every = multihost_utils.process_allgather(np.asarray([process_id]), tiled=True)
    summary = {"losses": losses, "initial_param_norm": norm, "param_change": change}
    # Continuous eval: process 0 lists the checkpoints and every process gets the same steps.
    followed = [list(checkpoints.follow_steps(out_dir, a, None, 0.05, 0)) for a in (None, 2)]
    seen = multihost_utils.process_allgather(np.asarray([len(f) for f in followed] + followed[0]))
    summary["followed_by_process"] = np.asarray(seen).reshape(processes, -1).tolist()
    if processes > 1:  # collect every host's view of the layouts on process 0
        text = json.dumps(layouts)
        mine = np.frombuffer(text.encode().ljust(8192), np.uint8)
        views = multihost_utils.process_allgather(mine)
        layouts = {
            key: {str(h): json.loads(bytes(v).decode().strip())[key] for h, v in enumerate(views)}
            for key in layouts
        }
    else:
        layouts = {key: {"0": value} for key, value in layouts.items()}
    if process_id == 0:
        assert sorted(np.asarray(every).tolist()) == list(range(processes))
        np.savez(os.path.join(out_dir, "params.npz"), **params)
        with open(os.path.join(out_dir, "layouts.json"), "w") as f:
            json.dump({**layouts, **summary}, f)


if __name__ == "__main__":
    directory, count, pid, coordinator_port, restore_dir = sys.argv[1:6]
    _worker(directory, int(count), int(pid), int(coordinator_port), restore_dir)
