"""The docs against the code they describe.

docs/MACROS.md against the command table: its macro table is the one `help_text.macro_table()`
renders from t5tpu/cli/commands.py (what every command's --help lists, itself checked against
the run files in test_help.py), so no macro is missing, none is listed that no command reads, and
every default is the command's. docs/memory_plan.md's experiment table is the one
`plan_table.table()` renders from `t5tpu plan` of every TPU experiment. docs/ARCHITECTURE.md
against the tree and the imports: every module it names exists, every module is named, and its
layers are the import graph's. docs/ stays under 100 KB, docs/PERFORMANCE.md stays short, and
every command in it runs something that exists. A doc's section named elsewhere ('docs/X.md,
"Section"') is one of its headings."""

import os
import pathlib
import re
import shlex

import pytest
import test_architecture
from cli_runs import ROOT

from t5tpu.cli import commands, help_text
from t5tpu.runners import plan_table

MACROS_DOC = os.path.join(ROOT, "docs", "MACROS.md")
REGENERATE = "python -m t5tpu.cli.help_text docs/MACROS.md"


def _doc() -> str:
    with open(MACROS_DOC, encoding="utf-8") as file:
        return file.read()


def _table_rows(text: str) -> dict[str, list[str]]:
    """The macro rows of every Markdown table in `text`: NAME -> its cells after the name."""
    rows = {}
    for line in text.splitlines():
        match = re.fullmatch(r"\| `([A-Z][A-Z0-9_]*)` \|(.*)\|", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in match.group(2).split(" | ")]
    return rows


def test_macros_doc_holds_the_generated_table():
    text = _doc()
    assert help_text.with_macro_table(text) == text, f"docs/MACROS.md is stale: run {REGENERATE}"


def test_macros_doc_lists_exactly_the_macros_the_commands_read_with_their_defaults():
    rows = _table_rows(_doc())
    read = {m.name for c in commands.GIN_COMMANDS.values() for m in c.macros}
    assert set(rows) == read, f"run {REGENERATE}"
    header = next(line for line in _doc().splitlines() if line.startswith("| macro |"))
    columns = [cell.strip() for cell in header.strip("|").split("|")][1:-1]
    assert columns == list(commands.GIN_COMMANDS)
    for command in commands.GIN_COMMANDS.values():
        column = columns.index(command.name)
        for macro in command.macros:
            assert rows[macro.name][column].strip("`") == macro.default, (command.name, macro)


def test_the_generated_table_has_a_row_per_macro_and_a_cell_per_command():
    table = help_text.macro_table()
    rows = _table_rows(table)
    assert len(rows) == len(table.splitlines()) - 2
    for name, cells in rows.items():
        assert len(cells) == len(commands.GIN_COMMANDS) + 1, name
        readers = [c for c in commands.GIN_COMMANDS.values() if name in {m.name for m in c.macros}]
        assert [bool(cell) for cell in cells[:-1]] == [
            c in readers for c in commands.GIN_COMMANDS.values()
        ]
        for command in readers:
            (macro,) = [m for m in command.macros if m.name == name]
            assert macro.meaning in cells[-1]


DOCS = pathlib.Path(ROOT) / "docs"


def _indented_block(text: str, after: str) -> list[str]:
    """The lines of the first indented (4-space) block after the line that starts with `after`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(after))
    block = []
    for line in lines[start + 1 :]:
        if line.startswith("    "):
            block.append(line[4:])
        elif block:
            break
    return block


def _architecture_tree() -> dict[str, str]:
    """ARCHITECTURE.md's folder tree: each entry's path ('tasks/', 't5tpu/cli/',
    't5tpu/errors.py') -> its text, continuation lines included. An entry is a name ending in
    '/' or '.py' indented two spaces a level; its text is what follows, on its line and below."""
    entries: dict[str, str] = {}
    parents: list[str] = []
    path = None
    for line in _indented_block((DOCS / "ARCHITECTURE.md").read_text(), "Every module"):
        match = re.match(r"((?:  )*)(\S+(?:/|\.py))(?:\s{2,}(.*))?$", line)
        if match and len(match.group(1)) <= 2 * len(parents):
            parents = parents[: len(match.group(1)) // 2]
            path = "".join(parents) + match.group(2)
            entries[path] = match.group(3) or ""
            if path.endswith("/"):
                parents.append(match.group(2))
        else:
            entries[path] += " " + line.strip()
    return entries


def _folders_and_modules() -> tuple[set[str], set[str]]:
    """The tree: t5tpu/'s and tasks/' packages as 't5tpu/cli/' and their modules as
    't5tpu/cli/main.py' (tasks/ and configs/ included as folders)."""
    folders, modules = {"configs/"}, set()
    for top in ("t5tpu", "tasks"):
        for path in (pathlib.Path(ROOT) / top).rglob("*.py"):
            relative = path.relative_to(ROOT).as_posix()
            folders.add(relative.rpartition("/")[0] + "/")
            modules.add(relative)
    return folders, modules


def test_the_architecture_names_only_modules_that_exist():
    _, modules = _folders_and_modules()
    for path, text in _architecture_tree().items():
        assert os.path.exists(os.path.join(ROOT, path)), f"docs/ARCHITECTURE.md: no {path}"
        if path == "configs/":
            for folder in re.findall(r"\b(\w+)/", text):
                assert os.path.isdir(os.path.join(ROOT, path, folder)), f"no configs/{folder}/"
        elif path.endswith("/"):
            for name in re.findall(r"\b(\w+\.py)\b", text):
                assert path + name in modules, f"docs/ARCHITECTURE.md: no {path}{name}"
    text = (DOCS / "ARCHITECTURE.md").read_text()
    packages = {"t5tpu.tasks": "tasks", "t5tpu.configs": "configs"}
    for dotted in re.findall(r"\bt5tpu(?:\.\w+)+", text):
        top = next((packages[p] for p in packages if dotted.startswith(p)), None)
        base = top + dotted.removeprefix(f"t5tpu.{top}") if top else dotted
        file = os.path.join(ROOT, *base.split("."))
        assert os.path.isdir(file) or os.path.exists(file + ".py"), f"no module {dotted}"


def test_the_architecture_names_every_folder_and_module():
    folders, modules = _folders_and_modules()
    tree = _architecture_tree()
    assert folders <= set(tree), f"add to docs/ARCHITECTURE.md: {sorted(folders - set(tree))}"
    configs = set(re.findall(r"\b(\w+)/", tree["configs/"]))
    assert configs == {p.name for p in (pathlib.Path(ROOT) / "configs").iterdir() if p.is_dir()}
    named = {
        folder + name
        for folder, text in tree.items()
        if folder.endswith("/")
        for name in re.findall(r"\b(\w+\.py)\b", text)
    }
    unnamed = sorted(m for m in modules - named - set(tree) if not m.endswith("/__init__.py"))
    assert not unnamed, f"name these in docs/ARCHITECTURE.md: {unnamed}"


def _layers() -> list[set[str]]:
    """ARCHITECTURE.md's layers, top first, as test_architecture's units ('t5tpu.cli')."""
    text = (DOCS / "ARCHITECTURE.md").read_text()
    return [
        {"t5tpu" if n == "t5tpu" else f"t5tpu.{n.removesuffix('.py')}" for n in line.split(", ")}
        for line in _indented_block(text, "Imports point down")
    ]


def test_the_architecture_layers_are_the_import_graph():
    layers = _layers()
    layer_of = {unit: i for i, layer in enumerate(layers) for unit in layer}
    units = {test_architecture._unit(m) for m in test_architecture._modules()}
    assert sum(len(layer) for layer in layers) == len(layer_of), "a unit in two layers"
    assert set(layer_of) == units, (set(layer_of) ^ units, "docs/ARCHITECTURE.md's layers")
    upward = sorted(
        (source, target)
        for source, targets in test_architecture._unit_graph().items()
        for target in targets
        if layer_of[target] <= layer_of[source]
    )
    assert not upward, f"imports not pointing down docs/ARCHITECTURE.md's layers: {upward}"


PERFORMANCE_LIMIT = 15_000


def test_performance_notes_stay_short():
    size = len((DOCS / "PERFORMANCE.md").read_text(encoding="utf-8"))
    assert size <= PERFORMANCE_LIMIT, f"docs/PERFORMANCE.md: {size} characters"


def _fenced_commands(text: str) -> list[list[str]]:
    """The commands of the fenced code blocks, continuation lines joined, comments dropped."""
    commands_ = []
    for block in re.findall(r"^```\w*\n(.*?)^```", text, re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and (re.match(r"\w+=", words[0]) or words[0] == "/usr/bin/time"):
                words = words[1:]
            if words:
                commands_.append(words)
    return commands_


def _check_t5tpu(words: list[str]) -> None:
    command = commands.find(words[1])
    assert command is not None, words
    flags = [w.split("=")[0] for w in words[2:] if w.startswith("--")]
    if command.name in commands.GIN_COMMANDS:
        assert all(f.startswith("--gin") for f in flags), words
    else:
        known = command.module.parser()._option_string_actions
        assert all(f in known or f.startswith("--gin.") for f in flags), words


def _check_script(words: list[str]) -> None:
    path = os.path.join(ROOT, words[1])
    assert os.path.isfile(path), words
    source = pathlib.Path(path).read_text()
    for flag in (w.split("=")[0] for w in words[2:] if w.startswith("--")):
        assert flag.startswith("--gin.") or f'"{flag}"' in source, (flag, words)


def test_every_performance_command_runs_something_that_exists():
    found = _fenced_commands((DOCS / "PERFORMANCE.md").read_text())
    assert len(found) >= 5
    for words in found:
        program = os.path.basename(words[0])
        if program == "t5tpu":
            _check_t5tpu(words)
        elif program in ("python", "bash"):
            _check_script(words)
        else:
            assert program == "pip" and words[1] == "install", words


def test_every_named_doc_section_is_a_heading():
    named = re.compile(r"\b(\w+)\.md[,:]? \(?\"([^\"\n]+)\"")
    for top in ("t5tpu", "tasks", "configs", "docs", "scripts", "tests"):
        for path in (pathlib.Path(ROOT) / top).rglob("*"):
            if path.suffix not in (".py", ".md", ".gin", ".sh") or path.name == "test_docs.py":
                continue
            for doc, section in named.findall(path.read_text(encoding="utf-8")):
                headings = re.findall(r"^#+ (.*)$", (DOCS / f"{doc}.md").read_text(), re.M)
                assert any(h.startswith(section) for h in headings), (str(path), doc, section)


DOCS_LIMIT = 110_000


def test_the_docs_stay_under_110_kb():
    sizes = {p.name: p.stat().st_size for p in DOCS.glob("*.md")}
    assert sum(sizes.values()) <= DOCS_LIMIT, f"docs/*.md: {sum(sizes.values())} bytes, {sizes}"


PLAN_TABLE_REGENERATE = "python -m t5tpu.runners.plan_table docs/memory_plan.md"


def _plan_doc() -> str:
    return (DOCS / "memory_plan.md").read_text(encoding="utf-8")


def test_the_memory_plan_table_has_a_row_per_tpu_experiment():
    """Without planning: the generated table's rows are the experiments there are."""
    text = _plan_doc()
    start = text.index(plan_table.TABLE_BEGIN)
    rows = [
        tuple(cell.strip() for cell in line.split("|")[1:4])
        for line in text[start : text.index(plan_table.TABLE_END)].splitlines()
        if line.startswith("| ") and not line.startswith(("| size", "| ---"))
    ]
    expected = [plan_table._name_parts(p) for p in plan_table.experiments()]
    assert sorted(rows) == sorted(expected), f"docs/memory_plan.md: run {PLAN_TABLE_REGENERATE}"


@pytest.mark.slow
def test_the_memory_plan_table_is_the_generated_one():
    """Plans every TPU experiment (no compile; seconds each, a minute for a step that does not
    fit, whose knobs are replanned); each experiment file's header states the plan's peak."""
    text, rendered = _plan_doc(), plan_table.table()
    assert plan_table.with_table(text, rendered) == text, (
        f"docs/memory_plan.md: run {PLAN_TABLE_REGENERATE}"
    )
    peaks = {
        tuple(cells[:3]): cells[12].strip("*")
        for cells in (
            [cell.strip() for cell in line.split("|")[1:-1]] for line in rendered.splitlines()[2:]
        )
    }
    for path in plan_table.experiments():
        header = (pathlib.Path(ROOT) / path).read_text(encoding="utf-8")
        assert f"peak {peaks[plan_table._name_parts(path)]} GiB of" in header, path
