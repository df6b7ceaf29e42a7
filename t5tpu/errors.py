"""Errors that t5tpu reports to the user without a traceback."""

import argparse


class UserError(Exception):
    """An error the user caused and can fix; main.py prints its message as one line and exits 2.

    The message must say what is wrong and what to do about it.
    """


def one_line_message(error: Exception) -> str:
    """The error's own message, without what gin appends.

    An exception raised inside a gin configurable reaches the caller as a proxy whose str() has
    "In call to configurable ..." lines added; the first line is the message that was raised.
    """
    lines = str(error).splitlines()
    return lines[0] if lines else type(error).__name__


class ArgumentParser(argparse.ArgumentParser):
    """The tools' flag parser: a bad or missing flag is a UserError (one line, exit 2) like the
    rest of the command line, not argparse's usage block."""

    def error(self, message: str):
        raise UserError(f"{message}; see {self.prog} --help")
