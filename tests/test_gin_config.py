"""t5tpu/config's services to the rest: a checkpoint's model gin files read without touching the
caller's gin config, a runner's bound settings as a typed object, and the validators' one
message style."""

from __future__ import annotations

import dataclasses
import json

import gin
import pytest
from cli_runs import TINY_EXPERIMENT

from t5tpu import validators
from t5tpu.config import gin_setup, runner_settings
from t5tpu.errors import UserError
from t5tpu.formats import loader
from t5tpu.model import decoding_settings
from t5tpu.runners import infer


def _state() -> tuple:
    return gin.config_str(), gin.operative_config_str(), list(gin.config._LOCATION_PREFIXES)


def test_reading_a_checkpoints_model_leaves_the_callers_gin_config_as_it_was():
    gin_setup.parse([TINY_EXPERIMENT], ["TRAIN_STEPS = 7", "NUM_BEAMS = 3"], [])
    before = _state()
    model = loader.model_from_gin(["configs/models/t5_1_1/tiny.gin"], None)
    config = model.config
    assert (config.emb_dim, config.num_encoder_layers, config.dropout_rate) == (128, 2, 0.0)
    assert model.vocabulary.vocab_size == 1024
    assert _state() == before
    assert gin.query_parameter("%TRAIN_STEPS") == 7
    assert runner_settings.infer_decoding().num_beams == 3


def test_a_bad_model_file_leaves_the_callers_gin_config_as_it_was(tmp_path):
    gin_setup.parse([TINY_EXPERIMENT], ["TRAIN_STEPS = 7"], [])
    before = _state()
    bad = tmp_path / "bad.gin"
    bad.write_text("T5Config.emb_dim = \n")
    with pytest.raises(UserError, match="cannot read the model from"):
        loader.model_from_gin([str(bad)], None)
    assert _state() == before


def test_infer_settings_are_the_bound_values_else_the_runners_defaults():
    gin_setup.parse([TINY_EXPERIMENT], ["NUM_BEAMS = 4", "infer.beam_alpha = 0.8", "SEED = 7"], [])
    settings = runner_settings.bound_settings(infer.infer, runner_settings.InferSettings)
    assert settings.truncation == "warn"
    chosen = runner_settings.infer_decoding()
    assert (chosen.num_beams, chosen.beam_alpha, chosen.temperature, chosen.top_k) == (4, 0.8, 0, 0)
    assert runner_settings.infer_decoding(decoding_settings.DecodingSettings(seed=3)).seed == 7
    assert (
        runner_settings.infer_decoding(decoding_settings.DecodingSettings(num_beams=2)).num_beams
        == 4
    )
    assert settings.task_feature_lengths == gin_setup.bound_value("infer.task_feature_lengths")
    assert settings.model_dir is None  # the experiment leaves MODEL_DIR to the command line


def test_a_setting_the_runner_does_not_take_fails_loudly():
    @dataclasses.dataclass(frozen=True)
    class Renamed:
        num_beam: int

    with pytest.raises(TypeError, match="infer has no argument 'num_beam'"):
        runner_settings.bound_settings(infer.infer, Renamed)


@pytest.mark.parametrize(
    "rule, value, message",
    [
        (validators.whole(low=1), 0, "X = 0 must be a whole number >= 1"),
        (validators.whole(low=1), True, "X = True must be a whole number >= 1"),
        (validators.whole(low=1), 2.0, "X = 2.0 must be a whole number >= 1"),
        (validators.whole(0, 3), 4, "X = 4 must be a whole number from 0 to 3"),
        (validators.number(above=0), False, "X = False must be a number > 0"),
        (validators.number(low=0), float("nan"), "X = nan must be a number >= 0"),
        (validators.number(low=0, below=1), 1, "X = 1 must be a number in [0, 1)"),
        (validators.optional(validators.whole(low=1)), 0, "X = 0 must be None or a whole"),
        (validators.choice(("warn", "error")), "cut", "X = 'cut' must be 'warn' or 'error'"),
        (validators.choice({"a": "first", "b": "second"}), 1, "X = 1 must be 'a' (first) or 'b'"),
        (validators.multiple(4, "the 4 devices"), 6, "X = 6 must be a positive multiple of the 4"),
    ],
)
def test_each_rule_refuses_in_one_message_style(rule, value, message):
    with pytest.raises(UserError) as error:
        rule.check("X", value)
    assert str(error.value).startswith(message), str(error.value)


def test_rules_accept_what_they_describe():
    assert validators.whole(low=1).check("X", 3) == 3
    assert validators.number(low=0).check("X", 0) == 0
    assert validators.optional(validators.whole(low=1)).check("X", None) is None
    assert validators.choice(("warn", "error")).check("X", "warn") == "warn"
    assert not validators.choice((1, 2)).accepts(True)  # True == 1, but not a choice of 1
    assert validators.is_instance(True, bool) and not validators.is_instance(True, (int, float))
    shown = validators.whole(1, 16).message("parameter num_beams", 0, shown=json.dumps)
    assert shown == "parameter num_beams = 0 must be a whole number from 1 to 16"
    assert validators.whole().message("T", 1.5, example="1000") == (
        "T = 1.5 must be a whole number, e.g. 1000"
    )


def test_train_steps_are_read_for_continuous_evaluation():
    from t5tpu.runners import train

    gin_setup.parse([TINY_EXPERIMENT], ["TRAIN_STEPS = 7"], [])
    steps = runner_settings.bound_settings(train.train, runner_settings.TrainSteps)
    assert steps == runner_settings.TrainSteps(train_steps=7, relative_steps=False)
    gin_setup.parse([TINY_EXPERIMENT], ["TRAIN_STEPS = 7", "train.relative_steps = True"], [])
    assert runner_settings.bound_settings(train.train, runner_settings.TrainSteps).relative_steps


def test_a_runners_settings_by_name_need_no_gin_file_and_no_import_of_runners():
    """`t5tpu serve --model=DIR` reads infer's settings by name (serve does not import runners),
    and may parse no gin file at all: a fresh process finds infer's defaults all the same."""
    import subprocess
    import sys

    code = (
        "from t5tpu.config import runner_settings as r\n"
        "s, d = r.bound_settings('infer', r.InferSettings), r.infer_decoding()\n"
        "print(d.num_beams, s.truncation, d.beam_alpha)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "warn", "0.6"]
