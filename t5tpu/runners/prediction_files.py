"""The files `t5tpu infer` writes: one JSONL file of predictions per checkpoint step, in
MODEL_DIR/inference (storage.model_dir.inference_dir; INFER_OUTPUT_DIR/inference when it is set),
named by the settings that change the predictions (file_name) and never another input's
(own_file). The chunks they are assembled from are runners/infer_chunks.py's.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable

from etils import epath

from t5tpu.model import decoding


def file_name(
    source: str,
    step: int,
    num_examples: int | None,
    settings: decoding.DecodingSettings,
) -> str:
    """<source>-<step>[-first<N>][-beam<B>-alpha<A> | -temp<T>[-top<K>]-seed<S>].jsonl.

    Every setting that changes the predictions is in the name, so decoding the same inputs
    another way never replaces earlier predictions, while the same command (deterministic, seed
    included) rewrites its own file. Greedy decoding of every input keeps the plain name."""
    name = f"{source}-{step}"
    if num_examples is not None:
        name += f"-first{num_examples}"
    if settings.num_beams > 1:
        name += f"-beam{settings.num_beams}-alpha{settings.beam_alpha:g}"
    elif settings.samples:
        top = f"-top{settings.top_k}" if settings.top_k else ""
        name += f"-temp{settings.temperature:g}{top}-seed{settings.seed}"
    return f"{name}.jsonl"


def _holds(path: str, inputs: Iterable[str]) -> bool:
    """Whether `path` is a predictions file of exactly `inputs`, in order; both are read as
    streams, so neither is held in memory."""
    missing = object()
    try:
        with epath.Path(path).open() as f:
            held = (json.loads(line)["input"] for line in f if line.strip())
            pairs = itertools.zip_longest(held, inputs, fillvalue=missing)
            return all(a == b for a, b in pairs)
    except (ValueError, KeyError, TypeError):
        return False


def own_file(path: str, inputs: Iterable[str]) -> str:
    """`path`, unless it holds the predictions of other inputs (an input file of the same name
    in another folder, other INFER_INPUTS): then the first of <name>.2.jsonl, <name>.3.jsonl,
    ... that is free or holds these inputs' predictions. Rerunning a command rewrites its own
    file; another input's predictions are never replaced."""
    stem, ext = os.path.splitext(path)
    for n in itertools.count(1):
        candidate = path if n == 1 else f"{stem}.{n}{ext}"
        if not epath.Path(candidate).exists() or _holds(candidate, inputs):
            return candidate


def predictions_path(
    folder: str,
    source: str,
    step: int,
    *,
    num_examples: int | None,
    settings: decoding.DecodingSettings,
    inputs: Iterable[str],
) -> str:
    """Where the predictions of `inputs` at `step` go in `folder` (see the module docstring)."""
    return own_file(os.path.join(folder, file_name(source, step, num_examples, settings)), inputs)


def json_line(text: str, prediction: str, target: str | None = None) -> str:
    """One line of a predictions file: {"input", "prediction"} and "target" when known."""
    row = {"input": text, "prediction": prediction}
    if target is not None:
        row["target"] = target
    return json.dumps(row, ensure_ascii=False) + "\n"
