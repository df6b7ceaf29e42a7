"""Macro values out of range are refused right after parsing, naming the macro; values in range,
unbound macros and gin references pass."""

from __future__ import annotations

import gin
import pytest

from t5tpu.config import macro_limits
from t5tpu.errors import UserError

BAD = {
    "LEARNING_RATE = 'fast'": "LEARNING_RATE = 'fast' must be a number > 0",
    "LEARNING_RATE = 0": "LEARNING_RATE = 0 must be a number > 0",
    "TRAIN_STEPS = -5": "TRAIN_STEPS = -5 must be a whole number >= 0",
    "TRAIN_STEPS = 10.5": "TRAIN_STEPS = 10.5 must be a whole number",
    "BATCH_SIZE = 0": "BATCH_SIZE = 0 must be a whole number >= 1",
    "EVAL_BATCH_SIZE = True": "EVAL_BATCH_SIZE = True must be a whole number",
    "DROPOUT_RATE = 1.0": "DROPOUT_RATE = 1.0 must be a number in [0, 1)",
    "DROPOUT_RATE = -0.1": "DROPOUT_RATE = -0.1 must be a number in [0, 1)",
    "NUM_BEAMS = 0": "NUM_BEAMS = 0 must be a whole number from 1 to 16 (1: greedy or "
    "sampling), e.g. --gin.NUM_BEAMS=4",
    "TEMPERATURE = -1.0": "TEMPERATURE = -1.0 must be 0.0 (greedy) or a number from 1e-06",
    "TOP_K = -1": "TOP_K = -1 must be a whole number >= 0",
    "KEEP_CHECKPOINTS = 0": "KEEP_CHECKPOINTS = 0 must be None or a whole number >= 1",
    "TASK_FEATURE_LENGTHS = {'inputs': 0, 'targets': 4}": "TASK_FEATURE_LENGTHS = {'inputs': 0",
    "TASK_FEATURE_LENGTHS = {}": "must be None or a dict of feature lengths >= 1",
    "TASK_FEATURE_LENGTHS = 512": "must be None or a dict of feature lengths >= 1",
    "INFER_EXACT_INPUTS = 1": "must be True or False",
    "TOP_P = 0": "must be a number above 0 and at most 1",
    "REPETITION_PENALTY = 0": "must be a number from 0.001 to 1000 (1.0: none), e.g. "
    "--gin.REPETITION_PENALTY=1.2",
    "NO_REPEAT_NGRAM_SIZE = -2": "must be a whole number from 0 to 65536",
    "MIN_NEW_TOKENS = 'four'": "must be a whole number from 0 to 65536",
    "MODEL_DIR = ''": "MODEL_DIR = '' must be None or a path (a non-empty string), e.g. --gin.MO",
    "INFER_INPUT_FILE = 5": "INFER_INPUT_FILE = 5 must be None or a path",
}


@pytest.mark.parametrize("binding", list(BAD))
def test_a_value_out_of_range_names_the_macro(binding):
    gin.parse_config(binding)
    with pytest.raises(UserError) as error:
        macro_limits.check_macros()
    message = str(error.value)
    assert message.startswith(binding.split(" =")[0] + " = ") and BAD[binding] in message, message


def test_values_in_range_references_and_unbound_macros_pass():
    gin.parse_config(
        "\n".join(
            [
                "LEARNING_RATE = 1e-4",
                "TRAIN_STEPS = 0",  # a run that only writes its initial checkpoint
                "BATCH_SIZE = 8",
                "EVAL_BATCH_SIZE = %BATCH_SIZE",
                "DROPOUT_RATE = 0.0",
                "KEEP_CHECKPOINTS = None",
                "TEMPERATURE = 0.7",
                "TASK_FEATURE_LENGTHS = {'inputs': 512, 'targets': 128}",
                "MODEL_DIR = %gin.REQUIRED",
                "INFER_OUTPUT_DIR = 'gs://bucket/predictions'",
                "INITIAL_CHECKPOINT_PATH = None",
            ]
        )
    )
    macro_limits.check_macros()  # NUM_BEAMS and the others unbound: nothing to check


def test_every_limited_macro_is_a_run_macro_the_help_table_lists():
    from t5tpu.cli import commands

    listed = {m.name for c in commands.GIN_COMMANDS.values() for m in c.macros}
    assert set(macro_limits.LIMITS) <= listed, set(macro_limits.LIMITS) - listed
