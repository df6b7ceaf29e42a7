"""Every front end takes exactly the decoding options DecodingSettings has, under one name each:
an option added to the settings and not to infer, the Python API or serve (or the other way
round) fails here."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import re

from t5tpu.api import model as api_model
from t5tpu.model.decoding import DecodingSettings
from t5tpu.runners import infer
from t5tpu.serve import payloads

SETTINGS = {field.name for field in dataclasses.fields(DecodingSettings)}
# Where a front end's name differs: a row's own length is the call's max_length, and gin calls
# the seed random_seed (T5X's name).
PER_CALL = (SETTINGS - {"max_new_tokens"}) | {"max_length"}


def test_serve_takes_every_option_and_no_other():
    assert {field.name for field in dataclasses.fields(payloads.Decoding)} == PER_CALL
    assert set(payloads.DECODING_PARAMETERS) == PER_CALL


def test_the_python_api_takes_every_option_by_the_same_names():
    assert set(api_model._SETTINGS) == PER_CALL | {"exact_inputs"}
    predict = set(inspect.signature(api_model.T5Model.predict).parameters) - {"self", "inputs"}
    assert predict == set(api_model._SETTINGS)
    generate = set(inspect.signature(api_model.T5Model.generate_ids).parameters)
    assert generate - {"self", "input_ids"} == (PER_CALL - {"max_length"}) | {"max_new_tokens"}


def test_infer_takes_every_option_and_its_gin_file_binds_each_to_a_macro():
    names = (SETTINGS - {"max_new_tokens", "seed"}) | {"random_seed"}
    assert names <= set(inspect.signature(infer.infer).parameters)
    bound = re.findall(
        r"^infer\.(\w+) = %(\w+)$", pathlib.Path("configs/runs/infer.gin").read_text(), re.M
    )
    macros = dict(bound)
    for name in names - {"beam_alpha", "random_seed"}:  # gin-only: infer.beam_alpha, .random_seed
        assert macros.get(name) == name.upper(), name
