"""The flag parser of the tools (`t5tpu convert`, `prepare-quora`, `bench`)."""

from __future__ import annotations

import argparse
import textwrap

from t5tpu.errors import UserError

_WIDTH = 100


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's paragraphs and the example as written, and names each flag's
    default where it has a real one (not None, False or nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not (default is None or default is False or default in ([], "", argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text


class ToolParser(argparse.ArgumentParser):
    """argparse, with two t5tpu habits: a bad or missing flag is a UserError (one line, exit 2)
    like the rest of the command line, not argparse's usage block; and --help ends with an
    example command line."""

    def __init__(self, *, prog: str, description: str, example: str):
        paragraphs = [textwrap.fill(p, _WIDTH) for p in description.split("\n\n")]
        super().__init__(
            prog=prog,
            description="\n\n".join(paragraphs),
            epilog=f"example:\n  {example}",
            formatter_class=_HelpFormatter,
        )

    def add_gin_flags(self, *, gin_file_help: str) -> None:
        """--gin_file, --gin_bindings and --gin_search_paths, as the gin commands take them
        (--gin.NAME=VALUE is rewritten to a binding before parsing)."""
        self.add_argument(
            "--gin_file", action="append", default=[], metavar="FILE", help=gin_file_help
        )
        self.add_argument(
            "--gin_bindings",
            action="append",
            default=[],
            metavar="'NAME = VALUE'",
            help="gin bindings; --gin.NAME=VALUE works too",
        )
        self.add_argument(
            "--gin_search_paths", default="", metavar="DIR[,DIR...]", help="gin includes"
        )

    def error(self, message: str):
        raise UserError(f"{message}; see {self.prog} --help")
