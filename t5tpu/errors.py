"""Errors that t5tpu reports to the user without a traceback."""

import errno

# OSErrors that are the machine's, whatever was being written when they struck.
_ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO})


class UserError(Exception):
    """An error the user caused and can fix; the command line prints its message as one line
    and exits 2.

    The message must say what is wrong and what to do about it.
    """


class EnvironmentFault(Exception):
    """A fault of the machine rather than of the user's input: a full disk, a failing device
    while writing. The command line prints `t5tpu: error: <path>: <cause>` as one line and
    exits 1 (the input was fine: the same command may succeed once the cause is fixed)."""

    def __init__(self, path: str, cause: str):
        super().__init__(f"{path}: {cause}")
        self.path = path
        self.cause = cause


def environment_fault(error: Exception) -> EnvironmentFault | None:
    """`error` as an EnvironmentFault if it is one (or an OSError of a full disk or a failing
    device, wherever it struck), else None."""
    if isinstance(error, EnvironmentFault):
        return error
    if isinstance(error, OSError) and error.errno in _ENVIRONMENT_ERRNOS:
        return EnvironmentFault(error.filename or "t5tpu", error.strerror or str(error))
    return None


def one_line_message(error: Exception) -> str:
    """The error's own message, without what gin appends.

    An exception raised inside a gin configurable reaches the caller as a proxy whose str() has
    "In call to configurable ..." lines added; the first line is the message that was raised.
    """
    lines = str(error).splitlines()
    return lines[0] if lines else type(error).__name__
