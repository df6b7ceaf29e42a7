"""The text of `t5tpu --help` and of a gin command's --help, from the command table.

The tools' help is their argparse parser's own (`t5tpu convert --help`).
"""

from __future__ import annotations

import textwrap

from t5tpu.cli import commands, gin_flags

WIDTH = 100
# Beyond this, a first column would squeeze the text beside it: the text starts below it instead.
_MAX_COLUMN = 32


def _rows(rows: list[tuple[str, ...]], indent: int = 2) -> list[str]:
    """Rows as aligned columns; the last column is wrapped to WIDTH."""
    if not rows:
        return []
    widths = [min(max(len(row[i]) for row in rows), _MAX_COLUMN) for i in range(len(rows[0]) - 1)]
    text_start = indent + sum(w + 2 for w in widths)
    lines = []
    for *columns, text in rows:
        head = " " * indent + "".join(c.ljust(w + 2) for c, w in zip(columns, widths, strict=True))
        wrapped = textwrap.wrap(text, WIDTH - text_start) or [""]
        if len(head) > text_start:  # a column longer than its width: text on the next lines
            lines.append(head.rstrip())
            head = " " * text_start
        lines.append(head + wrapped[0])
        lines += [" " * text_start + line for line in wrapped[1:]]
    return lines


def _section(title: str, lines: list[str]) -> list[str]:
    return ["", title, *lines]


def overview() -> str:
    """`t5tpu --help`: every command with its one line, then the gin commands' flags."""
    lines = [
        "t5tpu: fine-tune, evaluate and run T5 models from gin files, with T5X's flags.",
        "",
        "usage: t5tpu COMMAND [FLAGS]   (t5tpu COMMAND --help: its flags, settings and an example)",
    ]
    gin_names = ", ".join(commands.GIN_COMMANDS)
    lines += _section(
        f"gin subcommands: {gin_names}",
        _rows([(c.name, c.summary) for c in commands.GIN_COMMANDS.values()]),
    )
    lines += _section(
        f"tools: {', '.join(commands.TOOLS)}",
        _rows([(c.name, c.summary) for c in commands.TOOLS.values()]),
    )
    lines += _section("flags of the gin subcommands:", _rows(gin_flags.help_rows()))
    lines += _section("example:", [f"  {commands.TRAIN.example}"])
    return "\n".join(lines)


def gin_command(command: commands.GinCommand) -> str:
    """A gin command's --help: what it does, its flags, the macros it reads, an example."""
    lines = [
        f"t5tpu {command.name}: {command.summary}",
        "",
        f"usage: t5tpu {command.name} --gin_file=FILE [--gin_file=FILE ...] "
        f"[{gin_flags.SHORTHAND} ...] [FLAGS]",
    ]
    lines += _section("flags:", _rows(gin_flags.help_rows()))
    macros = [(m.name, m.default, m.meaning) for m in command.macros]
    lines += _section(
        f"macros (set in a gin file or with {gin_flags.SHORTHAND}; {command.run_file} "
        "defines them):",
        _rows(macros),
    )
    notes = [
        *command.notes,
        "a task's own macros (QUORA_DATA_DIR, SQUAD_V1_TRAIN_FILE, ...) and any argument of a "
        "gin configurable can be bound the same way",
    ]
    lines += _section("notes:", [line for note in notes for line in _bullet(note)])
    lines += _section("example:", [f"  {command.example}"])
    return "\n".join(lines)


def _bullet(text: str) -> list[str]:
    wrapped = textwrap.wrap(text, WIDTH - 4)
    return [f"  - {wrapped[0]}", *(f"    {line}" for line in wrapped[1:])]


# docs/MACROS.md holds macro_table() between these two lines (tests/test_docs.py checks it).
MACRO_TABLE_BEGIN = (
    "<!-- generated from t5tpu/cli/commands.py by `python -m t5tpu.cli.help_text "
    "docs/MACROS.md`; do not edit by hand -->"
)
MACRO_TABLE_END = "<!-- end of the generated table -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default_cell(default: str | None) -> str:
    """A default as code; 'required' as the word; empty for a command that reads no such macro."""
    if default is None:
        return ""
    return default if default == "required" else f"`{default}`"


def macro_table() -> str:
    """Every gin command's macros as one Markdown table, from the command table (what each
    command's --help lists): a row per macro, its default under each command that reads it,
    and its meaning (each command's, where they differ)."""
    names = list(commands.GIN_COMMANDS)
    defaults: dict[str, dict[str, str]] = {}
    meanings: dict[str, dict[str, list[str]]] = {}
    for command in commands.GIN_COMMANDS.values():
        for macro in command.macros:
            defaults.setdefault(macro.name, {})[command.name] = macro.default
            meanings.setdefault(macro.name, {}).setdefault(macro.meaning, []).append(command.name)
    lines = [
        "| macro | " + " | ".join(names) + " | meaning |",
        "| --- |" + " --- |" * len(names) + " --- |",
    ]
    for name, by_command in defaults.items():
        cells = [_default_cell(by_command.get(c)) for c in names]
        said = meanings[name]
        meaning = (
            next(iter(said))
            if len(said) == 1
            else "; ".join(f"{', '.join(users)}: {text}" for text, users in said.items())
        )
        lines.append(f"| `{name}` | " + " | ".join(map(_cell, [*cells, meaning])) + " |")
    return "\n".join(lines)


def with_macro_table(document: str) -> str:
    """`document` with the text between MACRO_TABLE_BEGIN and MACRO_TABLE_END replaced by
    macro_table()."""
    start = document.index(MACRO_TABLE_BEGIN) + len(MACRO_TABLE_BEGIN)
    end = document.index(MACRO_TABLE_END, start)
    return f"{document[:start]}\n{macro_table()}\n{document[end:]}"


if __name__ == "__main__":  # python -m t5tpu.cli.help_text docs/MACROS.md: rewrites its table
    import pathlib
    import sys

    for path in map(pathlib.Path, sys.argv[1:]):
        path.write_text(with_macro_table(path.read_text(encoding="utf-8")), encoding="utf-8")
