"""The package's shape, read from its source: subpackages import each other without cycles, the
layers below the command line and the Python API never import them, every module's file name
is its own (a reader never has to ask which `convert.py`), and no function is longer than a
reader can follow at once."""

import ast
import collections
import pathlib

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
