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
    for name in names - {"random_seed"}:  # gin-only: infer.random_seed (T5X's name)
        assert macros.get(name) == name.upper(), name


def test_the_docs_name_every_option_where_each_front_end_is_described():
    """docs/SERVING.md lists serve's parameters, docs/MACROS.md (generated from the command
    table) infer's macros: an option missing from either fails here."""
    serving = pathlib.Path("docs/SERVING.md").read_text()
    missing = [name for name in sorted(PER_CALL) if f"`{name}`" not in serving]
    assert not missing, f"docs/SERVING.md does not list {missing}"
    macros = pathlib.Path("docs/MACROS.md").read_text()
    names = (SETTINGS - {"max_new_tokens", "seed"}) | {"random_seed"}
    missing = [n for n in sorted(names - {"random_seed"}) if f"`{n.upper()}`" not in macros]
    assert not missing, f"docs/MACROS.md does not list {missing}"
