"""docs/MACROS.md against the command table: its macro table is the one `help_text.macro_table()`
renders from t5tpu/cli/commands.py (what every command's --help lists, itself checked against
the run files in test_help.py), so no macro is missing, none is listed that no command reads, and
every default is the command's."""

import os
import re

from cli_runs import ROOT

from t5tpu.cli import commands, help_text

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
