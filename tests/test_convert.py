"""`t5tpu convert`: a Hugging Face directory becomes a t5tpu checkpoint plus model.gin that
`t5tpu train` fine-tunes from; --to=hf exports it back; existing output is never replaced
without --overwrite."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_runs import TINY_EXPERIMENT as EXPERIMENT
from cli_runs import file_digests, t5tpu
from flax import traverse_util
from t5x_checkpoints import STEP as T5X_STEP
from t5x_checkpoints import expected_values, write_t5x_checkpoint
from tiny import tiny_config

from t5tpu import api
from t5tpu.cli import convert as convert_command
from t5tpu.data import vocab
from t5tpu.errors import UserError
from t5tpu.formats import hf_format, loader
from t5tpu.formats.vocabulary_source import VocabularySource
from t5tpu.model import param_shapes
from t5tpu.model.network import T5Config, Transformer
from t5tpu.runners import train
from t5tpu.storage import checkpoints

# The tiny T5 1.1, narrower; its vocabulary is the bundled 1,024-piece model, so the Quora
# experiment runs.
CONFIG = tiny_config(emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64)
_BUNDLED = VocabularySource("sentencepiece", vocab.bundled_vocabulary_file(), 0)


def _params(config: T5Config, seed: int = 0):
    tokens = jnp.ones((1, 4), jnp.int32)
    boxed = Transformer(config).init(jax.random.PRNGKey(seed), tokens, tokens)["params"]
    return jax.tree_util.tree_map(np.asarray, nn.unbox(boxed))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A Hugging Face directory (written by the exporter that test_hf_format checks against
    transformers) with spiece.model and tokenizer_config.json."""
    directory = str(tmp_path_factory.mktemp("hf"))
    params = _params(CONFIG)
    hf_format.export(params, CONFIG, directory, _BUNDLED)
    return directory, params


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    directory, _ = hf_dir
    output = str(tmp_path_factory.mktemp("converted"))
    run = t5tpu("convert", "--from=hf", f"--input={directory}", f"--output_dir={output}")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"wrote {output}/checkpoint_0 (" in run.stdout
    return output


def _restore(model_dir: str, step: int, config: T5Config):
    abstract = param_shapes.abstract_params(config, unrolled=True)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    mngr = checkpoints.manager(model_dir, read_only=True)
    shardings = jax.tree_util.tree_map(lambda _: device, abstract)
    return jax.device_get(checkpoints.restore_params(mngr, step, abstract, shardings))


def _assert_same(a, b):
    flat_a = traverse_util.flatten_dict(a, sep="/")
    flat_b = traverse_util.flatten_dict(b, sep="/")
    assert sorted(flat_a) == sorted(flat_b)
    for name in flat_a:
        np.testing.assert_array_equal(flat_a[name], flat_b[name], err_msg=name)


def test_hf_import_writes_a_checkpoint_and_model_gin(hf_dir, converted):
    _, params = hf_dir
    assert sorted(os.listdir(converted)) == ["checkpoint_0", "model.gin", "spiece.model"]
    _assert_same(_restore(converted, 0, CONFIG), params)
    _assert_same(loader.open_checkpoint(f"{converted}/checkpoint_0").load(params), params)
    text = pathlib.Path(converted, "model.gin").read_text()
    for line in (
        "T5Config.vocab_size = 1024",
        "T5Config.emb_dim = 32",
        "T5Config.num_heads = 2",
        "T5Config.head_dim = 16",
        "T5Config.mlp_dim = 64",
        "T5Config.num_encoder_layers = 2",
        "T5Config.num_decoder_layers = 2",
        "T5Config.mlp_activations = ('gelu', 'linear')",
        "T5Config.logits_via_embedding = False",
        "T5Config.relative_attention_num_buckets = 32",
        "T5Config.relative_attention_max_distance = 128",
        f"default_vocabulary.sentencepiece_model_file = '{converted}/spiece.model'",
        "default_vocabulary.extra_ids = 0",
        f"INITIAL_CHECKPOINT_PATH = '{converted}/checkpoint_0'",
    ):
        assert line in text.splitlines(), line


def test_one_load_opens_its_checkpoint_once(hf_dir, converted, tmp_path, monkeypatch):
    """Each storage question is a round trip on gs://: t5tpu.load, and a run's
    INITIAL_CHECKPOINT_PATH, find the format and open the reader once, then pass them along."""
    detected, opened = [], []
    detect = loader.detect_format

    def counted_detect(path, *args, **kwargs):
        detected.append(path)
        return detect(path, *args, **kwargs)

    class CountedHF(hf_format.HFCheckpoint):
        def __init__(self, directory):
            opened.append(directory)
            super().__init__(directory)

    monkeypatch.setattr(loader, "detect_format", counted_detect)
    monkeypatch.setitem(loader.IMPORTERS, "hf", CountedHF)
    directory, params = hf_dir
    step_dir = f"{converted}/checkpoint_0"
    for path, found, readers in (
        (directory, directory, [directory]),
        (step_dir, step_dir, []),
        (converted, step_dir, []),  # a MODEL_DIR: its newest checkpoint
    ):
        detected.clear()
        opened.clear()
        model = api.load(path, batch_size=2, dtype="float32")
        assert (detected, opened) == ([found], readers), path
        _assert_same(jax.device_get(model.params), params)
    detected.clear()
    opened.clear()
    start = train._start_point(str(tmp_path), directory, train_steps=1, relative_steps=False)
    assert start.input_start_step == 0
    loaded = start.initial_checkpoint.load(param_shapes.abstract_params(CONFIG, unrolled=True))
    assert (detected, opened) == ([directory], [directory])
    _assert_same(loaded, params)


@pytest.mark.slow
def test_train_fine_tunes_from_the_converted_checkpoint(hf_dir, converted, tmp_path):
    """With a zero learning rate the first step must leave the imported weights untouched
    (bound on the schedule itself: the LEARNING_RATE macro refuses 0 as a mistake)."""
    run = t5tpu(
        "train",
        f"--gin_file={EXPERIMENT}",
        f"--gin_file={converted}/model.gin",
        f"--gin.MODEL_DIR='{tmp_path}'",
        "--gin.TRAIN_STEPS=1",
        "--gin.BATCH_SIZE=4",
        "--gin.constant_schedule.learning_rate=0.0",
        "--gin.EVAL_PERIOD=0",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 4}",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "training steps 0..1" in run.stdout
    _assert_same(_restore(str(tmp_path), 1, CONFIG), _restore(converted, 0, CONFIG))
    # The run's MODEL_DIR exports too: its config.gin says what the shapes cannot.
    output = tmp_path / "hf"
    assert convert_command.main(["--to=hf", f"--input={tmp_path}", f"--output_dir={output}"]) == 0
    for name in ("model.safetensors", "spiece.model"):
        original = pathlib.Path(hf_dir[0], name).read_bytes()
        assert (output / name).read_bytes() == original, name
    exported = json.loads((output / "config.json").read_text())
    original = json.loads(pathlib.Path(hf_dir[0], "config.json").read_text())
    # The run's DROPOUT_RATE (finetune.gin's 0.1) and its run record go with it; everything
    # else is unchanged. The record: the Quora task's, 32/4 tokens, greedy.
    assert (exported.pop("dropout_rate"), original.pop("dropout_rate")) == (0.1, 0.0)
    assert exported.pop("t5tpu_run")["lengths"] == {"inputs": 32, "targets": 4}
    greedy = {"max_new_tokens": 4, "num_beams": 1, "do_sample": False}
    assert exported.pop("task_specific_params") == {"text2text-generation": greedy}
    assert exported == original
    assert "warning" not in run.stderr  # the bundled vocabulary's 1,024 rows: no mismatch


def test_a_pretrained_embedding_of_another_vocabulary_is_warned_about(capsys):
    """A T5X checkpoint converted (32,128 rows) fine-tuned with the bundled 1,024 pieces."""

    class Model:
        config = T5Config(vocab_size=32128)
        vocabulary = vocab.default_vocabulary()

    start = train.StartPoint(None, initial_checkpoint=object(), input_start_step=0, last_step=1)
    train._warn_unused_rows(Model(), start)
    assert capsys.readouterr().err == (
        "t5tpu: warning: INITIAL_CHECKPOINT_PATH's embedding has 32,128 rows but the vocabulary "
        "bound here has 1,024 ids: the pretrained rows belong to another vocabulary's pieces; "
        "bind the checkpoint's own (default_vocabulary.sentencepiece_model_file) unless you "
        "mean to train new embeddings\n"
    )
    Model.config = T5Config(vocab_size=1024)  # a multiple of 128 already: no mismatch
    train._warn_unused_rows(Model(), start)
    train._warn_unused_rows(Model(), dataclasses.replace(start, initial_checkpoint=None))
    assert capsys.readouterr().err == ""


def test_export_to_hf_gives_back_the_same_directory(hf_dir, converted, tmp_path):
    directory, _ = hf_dir
    output = str(tmp_path / "hf")
    args = ["--to=hf", f"--input={converted}/checkpoint_0", f"--output_dir={output}"]
    assert convert_command.main(args) == 0
    for name in ("model.safetensors", "config.json", "spiece.model", "tokenizer_config.json"):
        original = pathlib.Path(directory, name).read_bytes()
        assert pathlib.Path(output, name).read_bytes() == original, name


def test_existing_output_is_kept_without_overwrite(hf_dir, converted):
    directory, _ = hf_dir
    before = file_digests(converted)
    with pytest.raises(UserError, match="already exists and is not empty; pass --overwrite"):
        convert_command.main([f"--input={directory}", f"--output_dir={converted}"])
    assert file_digests(converted) == before


def test_overwrite_replaces_the_output(hf_dir, tmp_path):
    directory, params = hf_dir
    (tmp_path / "stale.txt").write_text("old")
    args = ["--from=hf", f"--input={directory}", f"--output_dir={tmp_path}", "--overwrite"]
    assert convert_command.main(args) == 0
    assert not (tmp_path / "stale.txt").exists()
    _assert_same(_restore(str(tmp_path), 0, CONFIG), params)


def test_bad_input_fails_before_anything_is_written(tmp_path):
    output = tmp_path / "out"
    with pytest.raises(UserError, match="is not a checkpoint t5tpu reads"):
        convert_command.main([f"--input={tmp_path}", f"--output_dir={output}"])
    with pytest.raises(UserError, match="no config.json"):
        convert_command.main(["--from=hf", f"--input={tmp_path}", f"--output_dir={output}"])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 8}))
    with pytest.raises(UserError, match="lacks vocab_size"):
        convert_command.main(["--from=hf", f"--input={bad}", f"--output_dir={output}"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="holds no t5tpu checkpoint; give a MODEL_DIR or its"):
        convert_command.main(["--to=hf", f"--input={empty}", f"--output_dir={output}"])
    assert not output.exists()


def test_t5x_checkpoint_converts_with_its_step(tmp_path):
    t5_1_0 = {"mlp_activations": ("relu",), "logits_via_embedding": True}
    config = T5Config(**{**CONFIG.__dict__, **t5_1_0})
    flat = traverse_util.flatten_dict(_params(config, seed=1), sep="/")
    source = write_t5x_checkpoint(str(tmp_path / "t5x"), flat, T5X_STEP)
    output = str(tmp_path / "out")
    assert convert_command.main([f"--input={source}", f"--output_dir={output}"]) == 0
    expected = traverse_util.unflatten_dict(expected_values(flat), sep="/")
    _assert_same(_restore(output, T5X_STEP, config), expected)
    text = pathlib.Path(output, "model.gin").read_text()
    assert f"INITIAL_CHECKPOINT_PATH = '{output}/checkpoint_{T5X_STEP}'" in text
    assert "T5Config.mlp_activations = ('relu',)" in text
    assert "# Not in the checkpoint, assumed as in T5: ReLU feed-forward" in text
    assert "carries no vocabulary" in text


def test_model_from_gin_without_shapes_reads_the_gin_files_alone():
    """t5tpu.load of a T5X or Mesh TF checkpoint with gin files passes no shapes: the names and
    shapes are checked when the parameters are read."""
    model = loader.model_from_gin(["configs/models/t5_1_1/tiny.gin"], None)
    config, vocabulary = model.config, model.vocabulary
    assert (config.emb_dim, config.num_encoder_layers, config.vocab_size) == (128, 2, 1024)
    assert vocabulary.vocab_size == 1024
