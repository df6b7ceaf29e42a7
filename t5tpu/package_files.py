"""Files shipped inside the installed package, found with importlib.resources so that a wheel, an
editable install and a checkout all find them the same way: the gin configs (the repository's
top-level configs/, installed as the package t5tpu.configs) and the bundled assets (the CPU
vocabulary and the Quora sample)."""

from __future__ import annotations

import importlib.resources
import os


def config_search_path() -> str:
    """The directory holding configs/: gin resolves `configs/models/...` against it."""
    return os.path.dirname(os.fspath(importlib.resources.files("t5tpu.configs")))


def configs_dir(*parts: str) -> str:
    """A directory (or file) under the shipped configs, e.g. configs_dir('experiments')."""
    return os.fspath(importlib.resources.files("t5tpu.configs").joinpath(*parts))


def asset(*parts: str) -> str:
    """A bundled asset's path, e.g. asset('cpu_vocab.model')."""
    return os.fspath(importlib.resources.files("t5tpu").joinpath("assets", *parts))
