"""gin: the modules that define configurables, search paths, parsing and the operative config.

Configurables are declared with @gin.configurable where they are defined; this module holds the
one list of those modules, so a gin file can name any of them once `import_configurables` ran.
Those modules import neither TensorFlow nor seqio at their top (t5tpu.runtime.lazy_imports), so
parsing a run's gin files stays quick.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import io
import os
import re
import tokenize

import gin
import jax
from etils import epath

from t5tpu import package_files, validators
from t5tpu.config import macro_limits
from t5tpu.errors import UserError, environment_fault, one_line_message
from t5tpu.storage import atomic_files, locations, user_files

CONFIGURABLE_MODULES = (
    "t5tpu.model.network",
    "t5tpu.model.encoder_decoder",
    "t5tpu.training.optim",
    "t5tpu.partitioning",
    "t5tpu.data.vocab",
    "t5tpu.tasks.quora",
    "t5tpu.tasks.squad",
    "t5tpu.tasks.text_to_text",
    "t5tpu.runners.train",
    "t5tpu.runners.evaluate",
    "t5tpu.runners.infer",
    "t5tpu.runners.prepare_data",
    "t5tpu.runners.plan",
)


def import_configurables() -> None:
    """Imports the modules that define configurables, so that gin files can name them."""
    for module in CONFIGURABLE_MODULES:
        importlib.import_module(module)


def _is_remote_file(path: str) -> bool:
    return locations.is_remote(path) and epath.Path(path).exists()


# Far beyond any config: a larger file named as one is something else, and is not read whole.
MAX_GIN_FILE_BYTES = 4 << 20


class _GinText(io.StringIO):
    """A gin file's text as gin reads it: named, so gin's errors give the file, and turning the
    errors gin raises without a location (a statement still open at the end) into one line."""

    def __init__(self, text: str, path: str):
        super().__init__(text)
        self.name = path

    def __exit__(self, kind, error, traceback):
        super().__exit__(kind, error, traceback)
        if isinstance(error, tokenize.TokenError) and len(error.args) == 2:
            message, (line, _) = error.args
            raise UserError(f"bad gin config: {message} ({self.name}, line {line})") from None


def _gin_file(path: str) -> _GinText:
    """Every gin file (--gin_file and what it includes), local or gs:// (through epath, the
    client that reads the rest of a gs:// MODEL_DIR), read whole first: a binary or non-UTF-8
    file is refused naming the file and line instead of failing mid-parse."""
    text = user_files.read_text(path, what="gin file", max_bytes=MAX_GIN_FILE_BYTES)
    if "\0" in text:
        line = text[: text.index("\0")].count("\n") + 1
        raise UserError(f"gin file: {path} is not text (a NUL byte on line {line}); give a .gin")
    return _GinText(text, path)


def _is_gin_file(path: str) -> bool:
    return os.path.isfile(path) or _is_remote_file(path)


def _lookup_failing_as_absent(exists):
    """gin's last resort, a lookup on the Python path, fails with a TypeError when the folder of
    a missing include is a namespace package (the checkout's `configs/...` from its root): such a
    file is absent, so gin ends in its one 'Unable to open file' instead."""

    def checked(path: str) -> bool:
        try:
            return exists(path)
        except TypeError:
            return False

    return checked


def use_file_readers() -> None:
    """gin tries its readers in order, open() first, which decodes as it parses: a binary file
    would fail with neither its name nor its line. This reader goes first (gin has no public
    way). Done where gin files are parsed, once, never on import: importing t5tpu leaves gin
    as it was."""
    readers = gin.config._FILE_READERS  # noqa: SLF001
    if readers and readers[0][0] is _gin_file:
        return
    readers[:] = [
        (_gin_file, _is_gin_file),
        *((r, _lookup_failing_as_absent(e)) for r, e in readers),
    ]


def parse(gin_files: list[str], bindings: list[str], search_paths: list[str]) -> None:
    """Parses gin files then bindings (later ones win); bad input becomes a UserError."""
    import_configurables()
    use_file_readers()
    gin.clear_config()
    # `--gin_file=configs/...` resolves against the working directory, then the installed
    # package, so the bundled configs work from any directory.
    roots = [*search_paths, ".", package_files.config_search_path()]
    for path in roots:
        gin.add_config_file_search_path(path)
    if not gin_files:
        raise UserError("no --gin_file given; pass e.g. --gin_file=configs/experiments/<name>.gin")
    _check_files_exist(gin_files, roots)
    try:
        gin.parse_config_files_and_bindings(gin_files, bindings, finalize_config=False)
    except UserError as e:  # an included file's (_gin_file): gin adds lines naming the include
        raise UserError(one_line_message(e)) from None
    except OSError as e:
        raise UserError(
            f"{str(e).splitlines()[0]} Check the --gin_file path or add --gin_search_paths"
        ) from None
    except (ValueError, SyntaxError, tokenize.TokenError) as e:
        binding = (getattr(e, "text", None) or "").strip()
        if isinstance(e, SyntaxError) and binding and not e.filename:  # a command-line binding
            hint = _quoting_hint(binding)
            raise UserError(f"cannot parse the binding `{binding}`{hint}") from None
        if isinstance(e, SyntaxError) and e.filename:  # gin's str() gives the file's basename
            message = " ".join(line.strip() for line in str(e.msg).splitlines() if line.strip())
            raise UserError(f"bad gin config: {message} ({e.filename}, line {e.lineno})") from None
        raise UserError(f"bad gin config: {' '.join(_compact(e))}") from None
    _check_macros(bindings)
    macro_limits.check_macros()


def bind(parameter: str, value) -> None:
    """Binds `parameter` ('configurable.argument') to `value` over what was parsed: a command's
    own flag that overrides the gin files."""
    gin.bind_parameter(parameter, value)


def _check_files_exist(gin_files: list[str], roots: list[str]) -> None:
    """A missing --gin_file in one line. Checked here because gin's last resort, a lookup on the
    Python path, fails with a TypeError when a `configs` package is importable (the checkout's
    own, with the checkout as the working directory)."""
    for path in gin_files:
        candidates = (
            [path] if locations.is_absolute(path) else [os.path.join(root, path) for root in roots]
        )
        if not any(epath.Path(candidate).exists() for candidate in candidates):
            raise UserError(
                f"gin file not found: {path} (looked in {', '.join(roots[:-1])} and the "
                "installed configs); check the --gin_file path or add --gin_search_paths"
            )


def _check_macros(bindings: list[str]) -> None:
    """gin accepts a macro that nothing uses (a misspelled --gin.TRAIN_STEP=5 would leave the
    file's TRAIN_STEPS in force) and fails deep in the run on a %MACRO never bound."""
    config = re.sub(r"'[^'\n]*'|\"[^\"\n]*\"", "''", gin.config_str())  # no % in strings
    macros_section = config.split("# Parameters for", 1)[0]
    bound = set(re.findall(r"^([A-Za-z_]\w*) = ", macros_section, re.M))
    used = set(re.findall(r"%([A-Za-z_][\w.]*)", config)) - {"gin.REQUIRED"}
    unbound = sorted(used - bound)
    if unbound:
        raise UserError(f"%{unbound[0]} is used but never bound; add --gin.{unbound[0]}=VALUE")
    for binding in bindings:
        name = binding.split("=", 1)[0].strip()
        if "=" in binding and name.isidentifier() and name not in used:
            close = difflib.get_close_matches(name, sorted(used), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise UserError(f"{name} is bound but no setting uses %{name}{hint}")


def _quoting_hint(binding: str) -> str:
    """A bare string value is the commonest slip on a command line: say how to quote it."""
    name, _, value = binding.partition("=")
    value = value.strip()
    if not value or value[0] in "'\"@%([{" or value[0].isdigit():
        return ""
    return f"; strings need quotes: --gin.{name.strip()}=\"'{value}'\""


def _compact(error: Exception) -> list[str]:
    """gin's multi-line parse errors as a few stripped fragments (message and location)."""
    return [line.strip() for line in str(error).splitlines() if line.strip()][:3]


def _setting_name(runner_name: str, argument: str) -> str:
    """What the user set for a runner's argument: the macro the run files bind to it
    (EVAL_NUM_EXAMPLES for evaluate.num_examples), else the binding itself."""
    try:
        bound = gin.query_parameter(f"{runner_name}.{argument}")
    except ValueError:  # not bound at all
        return f"{runner_name}.{argument}"
    text = str(bound)
    if isinstance(bound, gin.config.ConfigurableReference) and text.startswith("%"):
        return text[1:]
    return f"{runner_name}.{argument}"


def bound_value(parameter: str):
    """The value `parameter` ('train.batch_size') is bound to in the parsed gin files (macros and
    @configurables evaluated; gin.REQUIRED as it is), or None when it is not bound. Lets one
    runner read another's settings from the same experiment file."""
    try:
        value = gin.query_parameter(parameter)
    except ValueError:
        return None
    if isinstance(value, gin.config.ConfigurableReference):
        value = value.scoped_configurable_fn() if value.evaluate else value.scoped_configurable_fn
    return value


def runner(fn):
    """Makes `fn` a gin root whose %gin.REQUIRED macros fail with one clear line.

    gin hands a macro set to %gin.REQUIRED through as a sentinel instead of failing, so each
    argument is checked here, and errors name the macro the user set.
    """

    whole_numbers = {
        name
        for name, parameter in inspect.signature(fn).parameters.items()
        if parameter.annotation in ("int", "int | None")
    }

    @functools.wraps(fn)
    def checked(**kwargs):
        missing = [
            _setting_name(fn.__name__, name)
            for name, value in kwargs.items()
            if value is gin.REQUIRED
        ]
        if missing:
            example = f"--gin.{missing[0]}=..."
            raise UserError(
                f"{', '.join(missing)} must be set: bind it in a gin file or pass {example}"
            )
        for name in whole_numbers & kwargs.keys():
            if kwargs[name] is not None:
                validators.whole().check(
                    _setting_name(fn.__name__, name), kwargs[name], example="1000"
                )
        try:
            return fn(**kwargs)
        except OSError as e:
            # gin re-raises what a configurable raised as a proxy that has lost an OSError's
            # errno: a full disk is told apart here, while it still can be.
            fault = environment_fault(e)
            if fault is None:
                raise
            raise fault from e

    return gin.configurable(checked)


def write_operative_config(
    path: str, keep_previous_as: str | None = None, *, setting: str = "MODEL_DIR"
) -> str:
    """Writes the config that the run actually used (every bound value that was read) to `path`
    (a storage.model_dir path), atomically (storage.atomic_files; `setting` is named when it
    cannot be written); on a multi-host run only process 0 writes it. With `keep_previous_as`
    (a path too), a different config already at `path` is renamed to it instead of being
    replaced (unless that path is taken: nothing is overwritten)."""
    if jax.process_index() != 0:
        return path
    # Through epath, as everything in MODEL_DIR: TensorFlow's gs:// client is a second one that
    # cannot be pointed elsewhere (a test's emulator) and fails where gcsfs is configured.
    config = gin.operative_config_str()
    with atomic_files.atomic_file(path, setting=setting) as f:
        f.write(config)
        f.flush()  # a full disk says so now, before the config there is moved aside
        if keep_previous_as:
            _keep_if_different(epath.Path(path), epath.Path(keep_previous_as), config)
    return path


def _keep_if_different(path: epath.Path, previous: epath.Path, config: str) -> None:
    if path.exists() and not previous.exists() and path.read_text() != config:
        path.rename(previous)
