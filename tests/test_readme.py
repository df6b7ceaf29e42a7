"""The README's commands run as written.

Its ```sh blocks are read, `\\`-continued lines joined and each line split as a shell would
(shlex). The train, eval, infer and plan examples then run for real, in the README's order,
through tests/cli_runs.py's t5tpu(...), with one mechanical substitution so that they run in a
temporary directory and in seconds:

- every MODEL_DIR of the README, '/tmp/qp', becomes a fresh temporary directory;
- `--gin.TRAIN_STEPS=300` (in Python: `TRAIN_STEPS=300`) becomes quick_training(STEPS)'s flags:
  STEPS steps of batch 8, a checkpoint at the last.

The helper commands are checked without running them: each helper the README names answers
--help, and a helper's example in a code block must parse. The ```text block that lists what
the demo produces is checked against the MODEL_DIR the runs wrote, and the ```python block runs
against that MODEL_DIR (its finetune then has nothing left to train). Nothing here reads the
network.
"""

import os
import re
import shlex
import subprocess
import sys

import pytest
from cli_runs import ROOT, TINY_EXPERIMENT, quick_training, succeeded, t5tpu

from t5tpu.cli import commands

pytestmark = [pytest.mark.slow, pytest.mark.smoke]

README = os.path.join(ROOT, "README.md")
README_MODEL_DIR = "/tmp/qp"
README_TRAIN_STEPS = "--gin.TRAIN_STEPS=300"
STEPS = 20
QUICKSTART = [["bash", "scripts/demo.sh"], ["bash", "scripts/test.sh"]]


def _readme() -> str:
    with open(README, encoding="utf-8") as file:
        return file.read()


def code_blocks(text: str, language: str) -> list[str]:
    """The bodies of the ```language fenced blocks of `text`, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", text, re.M | re.S)


def shell_commands(block: str) -> list[list[str]]:
    """Each command of a shell block as its argv: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", block)
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


def readme_commands() -> list[list[str]]:
    return [argv for block in code_blocks(_readme(), "sh") for argv in shell_commands(block)]


def substituted(argv: list[str], model_dir: str) -> list[str]:
    """argv with the README's MODEL_DIR replaced by `model_dir` and its training shortened."""
    out = []
    for arg in argv:
        if arg == README_TRAIN_STEPS:
            out += quick_training(STEPS)
        else:
            out.append(arg.replace(README_MODEL_DIR, model_dir))
    return out


@pytest.fixture(scope="module")
def gin_runs(tmp_path_factory):
    """The README's gin commands (train first, as written), each run once; (runs, MODEL_DIR)."""
    model_dir = str(tmp_path_factory.mktemp("readme") / "qp")
    runs = []
    for argv in readme_commands():
        if argv[0] == "t5tpu" and argv[1] in commands.GIN_COMMANDS:
            runs.append((argv, t5tpu(*substituted(argv[1:], model_dir))))
    return runs, model_dir


def test_every_command_in_the_readme_is_one_this_file_checks():
    argvs = readme_commands()
    assert argvs[:2] == QUICKSTART
    for argv in argvs[2:]:
        assert argv[0] == "t5tpu" and commands.find(argv[1]), argv
    assert {argv[1] for argv in argvs[2:]} >= set(commands.GIN_COMMANDS)


def test_quickstart_scripts_exist_and_parse():
    for argv in QUICKSTART:
        succeeded(subprocess.run(["bash", "-n", argv[1]], cwd=ROOT, capture_output=True, text=True))
    with open(os.path.join(ROOT, "scripts", "demo.sh"), encoding="utf-8") as file:
        demo = file.read()
    default_dir = re.search(r"MODEL_DIR=\$\{MODEL_DIR:-(\S+)\}", demo).group(1)
    assert f"`{default_dir}`" in _readme()
    assert TINY_EXPERIMENT in demo


def test_gin_commands_run_as_written(gin_runs):
    runs, model_dir = gin_runs
    assert [argv[1] for argv, _ in runs] == list(commands.GIN_COMMANDS)
    for argv, run in runs:
        assert run.returncode == 0, (" ".join(argv), run.stderr[-3000:])
    assert os.path.isdir(os.path.join(model_dir, f"checkpoint_{STEPS}"))


def test_what_the_demo_produces_is_what_the_commands_wrote(gin_runs):
    _, model_dir = gin_runs
    (listing,) = code_blocks(_readme(), "text")
    names = []
    for line in listing.splitlines():
        first_column = re.split(r"\s{2,}", line.strip())[0]
        names += [n for n in re.split(r",\s*|\s+", first_column) if n and n != "..."]
        names += re.findall(r"\b\w+\.gin\b", line)
    assert len(names) >= 6, names
    written = [
        os.path.relpath(os.path.join(directory, entry), model_dir)
        for directory, dirs, files in os.walk(model_dir)
        for entry in (*dirs, *files)
    ]
    for name in names:  # the README's steps (checkpoint_100, questions-300) stand for any step
        pattern = re.sub(r"\d+", r"\\d+", re.escape(name.rstrip("/")))
        assert any(re.fullmatch(pattern, path) for path in written), (name, sorted(written))


def test_helper_commands_are_all_named_and_answer_help():
    named = set(re.findall(r"`t5tpu ([a-z][a-z-]*)", _readme()))
    assert set(commands.TOOLS) <= named
    assert named <= {*commands.GIN_COMMANDS, *commands.TOOLS}
    for name in commands.TOOLS:
        run = succeeded(t5tpu(name, "--help", timeout=120))
        assert run.stdout.startswith(f"usage: t5tpu {name} ")


def test_helper_examples_in_code_blocks_parse():
    for argv in readme_commands():
        if argv[0] == "t5tpu" and argv[1] in commands.TOOLS:
            commands.TOOLS[argv[1]].module.parse_args(argv[2:])


def test_python_example_runs(gin_runs):
    runs, model_dir = gin_runs
    assert runs and runs[0][1].returncode == 0, "the README's train command failed"
    (code,) = code_blocks(_readme(), "python")
    assert "TRAIN_STEPS=300" in code and f'"{README_MODEL_DIR}"' in code
    flags = ", ".join(flag.removeprefix("--gin.") for flag in quick_training(STEPS))
    code = code.replace("TRAIN_STEPS=300", flags).replace(f'"{README_MODEL_DIR}"', repr(model_dir))
    # Each expression statement's value is printed, as a notebook would show it.
    script = "import ast, sys\ntree = ast.parse(sys.stdin.read())\n" + (
        "for node in tree.body:\n"
        "    if isinstance(node, ast.Expr):\n"
        "        print(repr(eval(compile(ast.Expression(node.value), '<readme>', 'eval'))))\n"
        "    else:\n"
        "        exec(compile(ast.Module([node], []), '<readme>', 'exec'))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        input=code,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    succeeded(run)
    predictions, verdict = run.stdout.strip().splitlines()[-2:]
    assert predictions.startswith("[") and verdict in {"True", "False"}
