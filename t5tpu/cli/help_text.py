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
