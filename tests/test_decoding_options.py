"""One description of how to decode: DecodingSettings and its rules (model/decoding_settings.py).
Every front end takes exactly its options under one name each, and refuses a bad value alike; a
second type that describes decoding options, or a front end that misses one, fails here."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import re

import pytest

from t5tpu.api import model as api_model
from t5tpu.config import macro_limits
from t5tpu.errors import UserError
from t5tpu.model import decoding_settings
from t5tpu.model.decoding_settings import DecodingSettings
from t5tpu.runners import infer
from t5tpu.serve import payloads

OPTIONS = set(decoding_settings.NAMES)
# gin's names: infer's lengths are TASK_FEATURE_LENGTHS', and the seed is T5X's random_seed.
GIN = (OPTIONS - {"max_new_tokens", "seed"}) | {"random_seed"}


def test_serve_and_the_python_api_take_every_option_and_no_other():
    assert set(payloads.DECODING_PARAMETERS) == OPTIONS | {"max_length"}
    predict = set(inspect.signature(api_model.T5Model.predict).parameters) - {"self", "inputs"}
    assert predict == OPTIONS | {"max_length", "exact_inputs"} == set(api_model._SETTINGS)
    generate = set(inspect.signature(api_model.T5Model.generate_ids).parameters)
    assert generate - {"self", "input_ids"} == OPTIONS


def test_infer_takes_every_option_and_its_gin_file_binds_each_to_a_macro():
    assert set(inspect.signature(infer.infer).parameters) >= GIN
    bound = re.findall(
        r"^infer\.(\w+) = %(\w+)$", pathlib.Path("configs/runs/infer.gin").read_text(), re.M
    )
    expected = {decoding_settings.GIN_NAMES.get(n, n): n.upper() for n in OPTIONS}
    del expected["max_new_tokens"]
    assert {name: macro for name, macro in bound if name in GIN} == expected
    assert set(expected.values()) <= set(macro_limits.LIMITS)


def test_no_second_type_describes_the_decoding_options():
    """A dataclass or NamedTuple with several of the options as fields, other than the settings
    and the programs' per-row arrays (decoding.RowSettings, built from the settings), would be
    a second description to keep in step."""
    allowed = {"DecodingSettings", "RowSettings"}
    found = []
    for path in pathlib.Path("t5tpu").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name not in allowed:
                fields = {
                    statement.target.id
                    for statement in node.body
                    if isinstance(statement, ast.AnnAssign)
                    and isinstance(statement.target, ast.Name)
                }
                if len(fields & OPTIONS) >= 3:
                    found.append(f"{path}:{node.name}")
    assert not found, f"decoding options described again in {found}"


BAD = [
    ("top_p", 1.5, "must be a number above 0 and at most 1"),
    ("top_p", 0, "must be a number above 0 and at most 1"),
    ("temperature", -1.0, "must be 0.0 (greedy) or a number from 1e-06 to 1e+06"),
    ("num_beams", 17, "must be a whole number from 1 to 16"),
    ("repetition_penalty", 0.0, "must be a number from 0.001 to 1000"),
    ("length_penalty", 11.0, "must be None or a number from -10 to 10"),
    ("seed", -1, "must be a whole number from 0 to 2147483647"),
    ("num_return_sequences", 2, "must be at most 1 with greedy decoding"),
    ("top_k", 10**6, "must be at most the vocabulary size"),
]


@pytest.mark.parametrize(("option", "value", "wanted"), BAD)
def test_every_front_end_refuses_a_bad_value_with_the_same_words(option, value, wanted):
    """gin's macro check (for the options that have macros), the engine's check that infer,
    eval and the Python API run, and serve's parameters: one rule, the name spelled each
    front end's way."""
    settings = dataclasses.replace(DecodingSettings(), **{option: value})
    with pytest.raises(UserError) as raised:
        settings.check(32128)
    assert str(raised.value).startswith(f"{option.upper()} = {value!r} {wanted}")
    limits = payloads.Limits(max_instances=4, max_length=8, vocab_size=32128)
    payload = {"instances": ["x"], "parameters": {option: value}}
    with pytest.raises(payloads.PayloadError) as refused:
        payloads.predict_request(payload, defaults=lambda _: DecodingSettings(), limits=limits)
    assert str(refused.value).startswith(f"parameter {option} = {value} {wanted}")
    limit = macro_limits.LIMITS.get(option.upper())
    if limit is not None and not limit.rule.accepts(value):  # bounds by others: check's own
        assert wanted in limit.rule.message(option.upper(), value)


def test_serve_takes_max_length_as_max_new_tokens_and_not_both():
    limits = payloads.Limits(max_instances=4, max_length=8, vocab_size=32128)
    defaults = DecodingSettings(max_new_tokens=8)
    for parameters in ({"max_length": 3}, {"max_new_tokens": 3}):
        payload = {"instances": ["x"], "parameters": parameters}
        request = payloads.predict_request(payload, defaults=lambda _: defaults, limits=limits)
        assert request.decoding.max_new_tokens == 3
    payload = {"instances": ["x"], "parameters": {"max_length": 3, "max_new_tokens": 3}}
    with pytest.raises(payloads.PayloadError, match="not both"):
        payloads.predict_request(payload, defaults=lambda _: defaults, limits=limits)
    payload = {"instances": ["x"], "parameters": {"max_new_tokens": 9}}
    with pytest.raises(payloads.PayloadError, match=r"at most the longest output .* \(8\)"):
        payloads.predict_request(payload, defaults=lambda _: defaults, limits=limits)


def test_the_docs_name_every_option_where_each_front_end_is_described():
    """docs/SERVING.md lists serve's parameters, docs/MACROS.md (generated from the command
    table) infer's macros: an option missing from either fails here."""
    serving = pathlib.Path("docs/SERVING.md").read_text()
    missing = [name for name in sorted(OPTIONS) if f"`{name}`" not in serving]
    assert not missing, f"docs/SERVING.md does not list {missing}"
    macros = pathlib.Path("docs/MACROS.md").read_text()
    names = sorted(OPTIONS - {"max_new_tokens"})
    missing = [n for n in names if f"`{n.upper()}`" not in macros]
    assert not missing, f"docs/MACROS.md does not list {missing}"
