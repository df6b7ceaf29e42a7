"""The checks every setting and every value read from a file goes through: whole numbers,
numbers, ranges, choices and types, each with the words its error uses, in one message style:

    NAME = VALUE must be WANTED[, e.g. EXAMPLE]

True is an int to Python but never a count or a number here, and a JSON true is not a number.
At the package root, beneath everything: the command line's macros (config.macro_limits), the
Python API, the server, the runners, partitioning and the readers of files all use these.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping

from t5tpu.errors import UserError


def is_instance(value, types: type | tuple[type, ...]) -> bool:
    """isinstance, where a bool is none of int, float or a number type unless bool is named."""
    named = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool):
        return bool in named
    return isinstance(value, named)


def is_whole(value, low: int | None = None, high: int | None = None) -> bool:
    """An int (not a bool) within [low, high], each bound optional."""
    return (
        is_instance(value, int)
        and (low is None or value >= low)
        and (high is None or value <= high)
    )


def is_number(value) -> bool:
    """A finite int or float (not a bool)."""
    return is_instance(value, int | float) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class Rule:
    """What a setting accepts, as a test and the words its error uses ("a whole number >= 1")."""

    accepts: Callable[[object], bool]
    wanted: str

    def message(self, name: str, value, *, example: str = "", shown=repr) -> str:
        """The one line that refuses `value` for `name`; `shown` writes the value as the user
        wrote it (repr for Python and gin, json.dumps for a request)."""
        text = f"{name} = {shown(value)} must be {self.wanted}"
        return f"{text}, e.g. {example}" if example else text

    def check(self, name: str, value, *, example: str = ""):
        """`value`, or a UserError that names `name` when it is refused."""
        if not self.accepts(value):
            raise UserError(self.message(name, value, example=example))
        return value


def whole(low: int | None = None, high: int | None = None) -> Rule:
    """A whole number, optionally >= low and <= high."""
    if low is not None and high is not None:
        wanted = f"a whole number from {low} to {high}"
    elif low is not None:
        wanted = f"a whole number >= {low}"
    elif high is not None:
        wanted = f"a whole number <= {high}"
    else:
        wanted = "a whole number"
    return Rule(lambda value: is_whole(value, low, high), wanted)


def multiple(of: int, what: str) -> Rule:
    """A whole number >= 1 that `of` divides; `what` names `of` ("the 8 data-parallel devices")."""
    return Rule(
        lambda value: is_whole(value, low=1) and value % of == 0, f"a positive multiple of {what}"
    )


def number(
    *,
    above: float | None = None,
    low: float | None = None,
    below: float | None = None,
    high: float | None = None,
) -> Rule:
    """A finite number, optionally > above, >= low, < below and <= high."""

    def accepts(value) -> bool:
        return (
            is_number(value)
            and (above is None or value > above)
            and (low is None or value >= low)
            and (below is None or value < below)
            and (high is None or value <= high)
        )

    if low is not None and below is not None:
        wanted = f"a number in [{low}, {below})"
    elif low is not None and high is not None:
        wanted = f"a number from {low:g} to {high:g}"
    elif above is not None and high is not None:
        wanted = f"a number above {above:g} and at most {high:g}"
    elif above is not None:
        wanted = f"a number > {above}"
    elif low is not None:
        wanted = f"a number >= {low}"
    else:
        wanted = "a number"
    return Rule(accepts, wanted)


def optional(rule: Rule) -> Rule:
    """None, or what `rule` accepts."""
    return Rule(lambda value: value is None or rule.accepts(value), f"None or {rule.wanted}")


def choice(options: Collection | Mapping[object, str]) -> Rule:
    """One of `options`, the same type and value, written as the user would ('warn' or
    'error'); a mapping's values say what each option does."""
    shown = [
        f"{option!r} ({options[option]})" if isinstance(options, Mapping) else repr(option)
        for option in options
    ]
    listed = shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"
    return Rule(lambda value: any(type(value) is type(o) and value == o for o in options), listed)


def boolean() -> Rule:
    """True or False (not 0, 1 or a string)."""
    return Rule(lambda value: isinstance(value, bool), "True or False")


def path() -> Rule:
    """A path as text: a non-empty str without a NUL (local or gs://)."""
    return Rule(
        lambda value: isinstance(value, str) and bool(value.strip()) and "\0" not in value,
        "a path (a non-empty string)",
    )
