"""`t5tpu --help` and every command's --help: what they list, and that they answer without
loading jax, TensorFlow, seqio or orbax (which take seconds to import). The command table's
macros are checked against the run files that define them."""

import json
import os
import re
import subprocess
import sys

import pytest
from cli_runs import ROOT, t5tpu

from t5tpu.cli import commands, gin_flags

HEAVY = ("jax", "jaxlib", "tensorflow", "seqio", "orbax", "flax", "torch", "transformers")
# Runs the command line's help path for each list of words in-process, then gives each tool a
# bad flag; after each stage, prints which of the heavy packages have been imported.
IMPORTS_SCRIPT = """
import contextlib, io, json, sys
from t5tpu.cli import main
from t5tpu.errors import UserError

every_help, heavy = json.loads(sys.argv[1]), set(sys.argv[2:])
for words in every_help:
    sys.argv = ["t5tpu", *words]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            main.dispatch()
    except SystemExit as e:
        assert e.code == 0, (words, e.code)
print(sorted({m.split(".")[0] for m in sys.modules} & heavy))
for tool in main.commands.TOOLS.values():
    try:
        tool.module.parse_args(["--no_such_flag"])
    except UserError:
        pass
print(sorted({m.split(".")[0] for m in sys.modules} & heavy))
"""


def _succeeded(*args):
    run = t5tpu(*args, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stderr == ""
    return run.stdout


def test_overview_lists_every_command_with_its_summary():
    text = _succeeded("--help")
    assert "gin subcommands: train, eval, infer, prepare-data, plan" in text
    assert "tools: prepare-quora, convert, bench" in text
    for command in [*commands.GIN_COMMANDS.values(), *commands.TOOLS.values()]:
        row = rf"^  {re.escape(command.name)} +{re.escape(command.summary)}$"
        assert re.search(row, text, re.M)
    for flag, _ in gin_flags.help_rows():
        assert flag in text
    assert _succeeded("help") == text


def test_no_command_is_one_line_usage_and_exit_2():
    run = t5tpu(timeout=60)
    assert run.returncode == 2
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith("t5tpu: error: expected one subcommand of train, ") and "usage:" in line


@pytest.mark.parametrize("words", [["frobnicate", "--help"], ["help", "frobnicate"]])
def test_help_of_an_unknown_command_is_one_line_and_exit_2(words):
    run = t5tpu(*words, timeout=60)
    assert run.returncode == 2
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith("t5tpu: error: expected one subcommand of ") and "frobnicate" in line


@pytest.mark.parametrize("name", list(commands.GIN_COMMANDS))
def test_gin_command_help_has_its_flags_macros_and_example(name):
    command = commands.GIN_COMMANDS[name]
    text = _succeeded(name, "--help")
    assert text.startswith(f"t5tpu {name}: {command.summary}\n")
    for flag, _ in gin_flags.help_rows():
        assert f"\n  {flag} " in text
    for macro in command.macros:
        assert re.search(rf"^  {macro.name} +{re.escape(macro.default)} ", text, re.M)
    assert text.rstrip().endswith(f"example:\n  {command.example}")
    assert _succeeded("help", name) == text


@pytest.mark.parametrize("name", list(commands.TOOLS))
def test_tool_help_has_its_flags_and_example(name):
    command = commands.TOOLS[name]
    text = _succeeded(name, "--help")
    assert text.startswith(f"usage: t5tpu {name} ")
    flags = [f for a in command.module.parser()._actions for f in a.option_strings]
    assert len(flags) > 2
    for flag in flags:
        assert flag in text
    assert text.rstrip().endswith(f"example:\n  {command.example}")
    assert _succeeded("help", name) == text


def test_help_and_bad_tool_flags_import_no_heavy_package():
    every_help = [
        ["--help"],
        ["help"],
        *([name, "--help"] for name in [*commands.GIN_COMMANDS, *commands.TOOLS]),
        ["help", "convert"],
    ]
    run = subprocess.run(
        [sys.executable, "-c", IMPORTS_SCRIPT, json.dumps(every_help), *HEAVY],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == ["[]", "[]"]


def _run_file_macros(path: str) -> dict[str, str]:
    """NAME -> default of each `NAME = value` line of a run file ('required' for gin.REQUIRED),
    and of the files it includes those it uses (eval.gin takes NUM_BEAMS from decoding.gin)."""
    macros = {}
    with open(os.path.join(ROOT, path)) as file:
        text = file.read()
    for included in re.findall(r"^include '(.*)'$", text, re.M):
        used = set(re.findall(r"%([A-Z][A-Z0-9_]*)", text))
        macros.update({k: v for k, v in _run_file_macros(included).items() if k in used})
    for line in text.splitlines():
        match = re.fullmatch(r"([A-Z][A-Z0-9_]*) = (.*?)(\s+#.*)?", line)
        if match:
            value = match.group(2)
            macros[match.group(1)] = "required" if value == "%gin.REQUIRED" else value
    return macros


@pytest.mark.parametrize("name", list(commands.GIN_COMMANDS))
def test_macros_in_help_are_the_run_files(name):
    command = commands.GIN_COMMANDS[name]
    defined = _run_file_macros(command.run_file)
    listed = {m.name: m.default for m in command.macros}
    assert {k: defined.get(k) for k in listed} == listed
    if name != "plan":  # plan reads a few of the training run's settings
        assert listed == defined


@pytest.mark.parametrize(
    "command", [*commands.GIN_COMMANDS.values(), *commands.TOOLS.values()], ids=lambda c: c.name
)
def test_examples_name_files_that_exist(command):
    assert command.example.startswith(f"t5tpu {command.name} ")
    for path in re.findall(r"--gin_file=(\S+)", command.example):
        assert os.path.isfile(os.path.join(ROOT, path)), path


def test_convert_flags_name_every_importer():
    from t5tpu.cli import convert as convert_command
    from t5tpu.formats import loader

    assert (*loader.IMPORTERS, "t5tpu") == convert_command.SOURCES
