"""The package's shape, read from its source: subpackages import each other without cycles, the
layers below the command line and the Python API never import them, every module's file name
is its own (a reader never has to ask which `convert.py`), and no function is longer than a
reader can follow at once."""

import ast
import collections
import dataclasses
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The repository's folders and the packages they install as (pyproject's package-dir).
SOURCES = {"t5tpu": ROOT / "t5tpu", "t5tpu.tasks": ROOT / "tasks"}
# On top: the command line, the Python API, the server (which runs the API's models), and
# `t5tpu` itself (whose `t5tpu.load` is the API's).
TOP = {"t5tpu", "t5tpu.api", "t5tpu.cli", "t5tpu.serve"}
# Lines from a function's `def` to the last line of its body (docstring in, decorators out).
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _imported(module: str, path: pathlib.Path) -> set[str]:
    """Every t5tpu module `module` imports, at its top or inside a function."""
    names = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from t5tpu import errors` imports the module t5tpu.errors; `from t5tpu.errors
            # import UserError`, a name in t5tpu.errors (_unit_graph trims it).
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {n for n in names if n == "t5tpu" or n.startswith("t5tpu.")}


def _unit(module: str) -> str:
    """A subpackage (`t5tpu.runners`), or a module at the package root (`t5tpu.errors`)."""
    return ".".join(module.split(".")[:2])


def _unit_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = collections.defaultdict(set)
    for module, path in modules.items():
        for target in _imported(module, path):
            # `from t5tpu.data import vocab` names the module t5tpu.data.vocab, or else an
            # attribute of the package t5tpu.data.
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if _unit(target) != _unit(module):
                graph[_unit(module)].add(_unit(target))
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as the path around it, or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_between_subpackages():
    graph = _unit_graph()
    assert {"t5tpu.runners", "t5tpu.model", "t5tpu.cli"} <= set(graph)  # the scan saw them
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_nothing_below_the_cli_and_the_api_imports_them():
    upward = {
        (source, target)
        for source, targets in _unit_graph().items()
        for target in targets
        if target in TOP and source not in TOP
    }
    assert not upward


def test_every_module_file_name_is_unique():
    names = collections.Counter(
        path.name for path in _modules().values() if path.name != "__init__.py"
    )
    assert not [name for name, count in names.items() if count > 1]
    # Nor one name and its plural (prediction_file.py beside prediction_files.py).
    stems = {name.removesuffix(".py") for name in names}
    assert not sorted(stem for stem in stems if f"{stem}s" in stems)


# --- the server names no task -----------------------------------------------------------------
# The tasks' modules that the server may name: the registry and the serving spec it mounts.
GENERIC_TASK_MODULES = {"__init__", "registry", "serving", "shaping", "metrics"}


@dataclasses.dataclass(frozen=True)
class TaskWords:
    """What only a task knows. `names` (its modules' and seqio tasks' names, and routes' or
    fields' names that no English text holds: is_duplicate, question1) are looked for in any
    identifier or string; `plain` words (answer, context) only as a whole string or a path's
    part, since the server says "answer" in its own sense too."""

    names: frozenset[str]
    plain: frozenset[str]


def _task_words() -> TaskWords:
    """The tasks' modules, and their routes' names, seqio tasks and fields (but a predict
    route's field: /v1/predict's own)."""
    from t5tpu.tasks import quora, serving

    from t5tpu import tasks

    names = {path.stem for path in SOURCES["t5tpu.tasks"].glob("*.py")} - GENERIC_TASK_MODULES
    names.add(quora.MIXTURE_NAME)
    words = set()
    for route in tasks.served_routes():
        names.add(route.task)
        words.add(route.name)
        if route.name != serving.PREDICT:
            words |= {field.name for field in route.fields}
    names |= {word for word in words if re.search(r"[_\d]", word)}
    return TaskWords(
        names=frozenset(w.lower() for w in names), plain=frozenset(w.lower() for w in words - names)
    )


def _task_knowledge(source: str, words: TaskWords) -> set[str]:
    """The task words in `source`'s code; comments and docstrings aside."""
    found = set()
    tree = ast.parse(source)
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    for node in ast.walk(tree):
        literal = isinstance(node, ast.Constant) and isinstance(node.value, str)
        if literal and id(node) not in docstrings:
            text = node.value.lower()
            found |= {w for w in words.names if re.search(rf"(?<!\w){re.escape(w)}(?!\w)", text)}
            found |= {w for w in words.plain if text == w or re.search(rf"/{w}(?!\w)", text)}
        for name in _identifiers(node):
            parts = name.lower().split("_")
            found |= {w for w in words.names if name.lower() == w or w in parts}
    return found


def _identifiers(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.alias):
        return node.name.split(".") + ([node.asname] if node.asname else [])
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, ast.keyword) and node.arg:
        return [node.arg]
    return []


def test_the_task_knowledge_finder_finds_task_knowledge():
    words = TaskWords(names=frozenset({"quora", "is_duplicate"}), plain=frozenset({"answer"}))
    assert _task_knowledge("from t5tpu.tasks import quora", words) == {"quora"}
    assert _task_knowledge('x = {"is_duplicate": "Answer"}', words) == {"is_duplicate", "answer"}
    assert _task_knowledge("def f(is_duplicate): return quora_rows", words) == words.names
    assert _task_knowledge('path = f"/v1/{x}/answer"', words) == {"answer"}
    plain_english = 'def answer(x):\n    return "the model can answer"'
    assert not _task_knowledge(plain_english, words)
    assert not _task_knowledge('"""About quora."""\n# is_duplicate\nduplicates = 1', words)


def test_the_server_names_no_task():
    """serve/ mounts whatever the tasks offer (tasks/serving.py): a task's name, route or
    field written in it would be a task's knowledge in the generic server."""
    words = _task_words()
    assert {"quora", "squad", "is_duplicate", "squad_v2", "question1"} <= words.names
    assert {"answer", "question", "context"} <= words.plain
    assert not (words.names | words.plain) & {"predict", "input", "score", "target"}
    found = {
        path.name: sorted(_task_knowledge(path.read_text(), words))
        for path in (SOURCES["t5tpu"] / "serve").glob("*.py")
    }
    assert not {name: words for name, words in found.items() if words}


def _long_functions(paths, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'path:line name length' of every function (nested ones and methods too) in `paths`
    longer than `limit` lines."""
    found = []
    for path in sorted(paths):
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{shown}:{node.lineno} {node.name} {length}")
    return found


def test_a_function_is_counted_from_its_def_to_its_last_line(tmp_path):
    path = tmp_path / "module.py"
    path.write_text(
        '@decorator\ndef outer():\n    """Doc."""\n\n    def inner():\n        return 1\n\n'
        "    return inner\n"
    )
    assert _long_functions([path], limit=6) == [f"{path}:2 outer 7"]
    assert _long_functions([path], limit=1) == [f"{path}:2 outer 7", f"{path}:5 inner 2"]
    assert _long_functions([path], limit=7) == []


def test_no_function_is_longer_than_the_limit():
    assert len(_modules()) > 100  # the scan saw t5tpu/ and tasks/
    long = _long_functions(_modules().values())
    assert not long, f"split these along their seams (at most {MAX_FUNCTION_LINES} lines): " + (
        "; ".join(long)
    )


def _source_files() -> dict[str, pathlib.Path]:
    return {
        path.relative_to(ROOT).as_posix(): path
        for folder in SOURCES.values()
        for path in folder.rglob("*.py")
    }


# What modules may say of gin where they define things: marking a configurable, the sentinel of
# an argument that must be bound. Parsing, querying, binding, scoping and clearing gin's global
# config are t5tpu/config's alone.
GIN_DEFINITIONS = {"configurable", "external_configurable", "register", "REQUIRED"}


def _gin_uses(tree: ast.AST) -> list[str]:
    """Every `gin.X` (and `gin.config...`) of a module, and what it imports from gin."""
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "gin":
            uses.append(f"gin.{node.attr}:{node.lineno}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "gin":
            uses.extend(f"from {node.module} import {a.name}:{node.lineno}" for a in node.names)
        elif isinstance(node, ast.Import):
            uses.extend(
                f"import {a.name}:{node.lineno}" for a in node.names if a.name.startswith("gin.")
            )
    return uses


def test_only_config_reads_parses_or_clears_gin():
    found = {
        name: uses
        for name, path in _source_files().items()
        if not name.startswith("t5tpu/config/")
        and (
            uses := [
                use
                for use in _gin_uses(ast.parse(path.read_text(), name))
                if use.split(":")[0].removeprefix("gin.") not in GIN_DEFINITIONS
            ]
        )
    }
    assert found == {}, "use t5tpu/config (gin_setup, runner_settings, checkpoint_gin)"


def test_the_gin_scan_sees_queries_and_imports():
    code = "import gin.config\nfrom gin import config_scope\ngin.clear_config()\ngin.REQUIRED\n"
    assert {use.split(":")[0] for use in _gin_uses(ast.parse(code))} == {
        "import gin.config",
        "from gin import config_scope",
        "gin.clear_config",
        "gin.REQUIRED",
    }


VALIDATORS = "t5tpu/validators.py"


def _bool_checks(tree: ast.AST) -> list[int]:
    """Lines of `isinstance(x, bool)` or `isinstance(x, (..., bool, ...))`."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            kinds = node.args[1:2]
            if kinds and isinstance(kinds[0], ast.Tuple):
                kinds = kinds[0].elts
            if any(getattr(kind, "id", None) == "bool" for kind in kinds):
                lines.append(node.lineno)
    return lines


def test_values_are_checked_only_by_the_validators():
    """True is an int to Python: the checks that say so, and the words their errors use, are
    written once (t5tpu/validators.py), so every setting is refused alike."""
    bool_checks, wordings = {}, {}
    for name, path in _source_files().items():
        if name == VALIDATORS:
            continue
        text = path.read_text()
        if lines := _bool_checks(ast.parse(text, name)):
            bool_checks[name] = lines
        if "whole number" in text:
            wordings[name] = text.count("whole number")
    assert bool_checks == {}, f"use {VALIDATORS}: is_whole, is_number, is_instance"
    assert wordings == {}, f"use {VALIDATORS}: whole(...).check or .message"
    assert _bool_checks(ast.parse((ROOT / VALIDATORS).read_text()))  # the scan sees them


# Run in a fresh interpreter: the settings a library import must leave as they were.
_IMPORT_STATE_SCRIPT = """
import os, sys, gin, jax
def state():
    return (
        list(gin.config._FILE_READERS),
        [type(f).__name__ for f in sys.meta_path if type(f).__module__.startswith("t5tpu")],
        os.environ.get("TF_CPP_MIN_LOG_LEVEL"),
        jax.config.jax_compilation_cache_dir,
        jax.config.jax_persistent_cache_min_compile_time_secs,
        jax.config.jax_persistent_cache_min_entry_size_bytes,
    )
before = state()
import t5tpu, t5tpu.api, t5tpu.config.gin_setup, t5tpu.config.checkpoint_gin
import t5tpu.config.runner_settings, t5tpu.formats.conversion, t5tpu.serve.model_setup
after = state()
assert after == before, (before, after)
print("unchanged")
"""


def test_importing_t5tpu_changes_neither_gin_nor_jax_settings():
    """Nor the import machinery or TensorFlow's log level: the CLI, load() and finetune() set
    those up when they start."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    run = subprocess.run(
        [sys.executable, "-c", _IMPORT_STATE_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["unchanged"]
