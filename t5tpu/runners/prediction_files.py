"""The files `t5tpu infer` writes: one JSONL file of predictions per checkpoint step, in
MODEL_DIR/inference (storage.model_dir.inference_dir; INFER_OUTPUT_DIR/inference when it is set),
named by the settings that change the predictions (file_name) and never another input's
(own_file). The chunks they are assembled from are runners/infer_chunks.py's.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable, Iterator

from etils import epath

from t5tpu.model import decoding_settings
from t5tpu.runners import infer_inputs
from t5tpu.storage import user_files

# An input line, its prediction and target, escaped as JSON: anything longer is not one.
_MAX_LINE_BYTES = 8 * infer_inputs.MAX_LINE_BYTES


def file_name(
    source: str,
    step: int,
    num_examples: int | None,
    settings: decoding_settings.DecodingSettings,
    exact_inputs: bool = False,
) -> str:
    """<source>-<step>[-first<N>][-exact][-beam<B>-alpha<A>[-n<N>] | -temp<T>[-top<K>][-topp<P>]
    -seed<S>][-rep<R>][-ngram<N>][-min<M>].jsonl (-exact: INFER_EXACT_INPUTS where the run's
    shaping changes the inputs; the last three: the penalties, where set).

    Every setting that changes the predictions is in the name, so decoding the same inputs
    another way never replaces earlier predictions, while the same command (deterministic, seed
    included) rewrites its own file. Greedy decoding of every input keeps the plain name."""
    name = f"{source}-{step}"
    if num_examples is not None:
        name += f"-first{num_examples}"
    if exact_inputs:
        name += "-exact"
    if settings.num_beams > 1:
        lp = settings.length_penalty  # Hugging Face's normalization, in place of T5X's alpha
        rank = f"-alpha{settings.beam_alpha:g}" if lp is None else f"-lp{lp:g}"
        name += f"-beam{settings.num_beams}{rank}"
        returned = settings.num_return_sequences
        name += f"-n{returned}" if returned > 1 else ""
    elif settings.samples:
        top = f"-top{settings.top_k}" if settings.top_k else ""
        top += f"-topp{settings.top_p:g}" if settings.top_p < 1 else ""
        name += f"-temp{settings.temperature:g}{top}-seed{settings.seed}"
    if settings.repetition_penalty != 1:
        name += f"-rep{settings.repetition_penalty:g}"
    if settings.no_repeat_ngram_size:
        name += f"-ngram{settings.no_repeat_ngram_size}"
    if settings.min_new_tokens:
        name += f"-min{settings.min_new_tokens}"
    return f"{name}.jsonl"


def _holds(path: str, inputs: Iterable[str]) -> bool:
    """Whether `path` is a predictions file of exactly `inputs`, in order; both are read as
    streams, so neither is held in memory. A file that is not one (damaged, another kind) holds
    no inputs: it is kept, and the predictions go to another name."""
    with user_files.open_binary(path, what="predictions file") as f:
        pairs = itertools.zip_longest(_held_inputs(f), inputs, fillvalue=_NOT_AN_INPUT)
        return all(a == b for a, b in pairs)


# Equal to no input text: what a line that is not a prediction holds.
_NOT_AN_INPUT = object()


def _held_inputs(f) -> Iterator[object]:
    """The "input" of each line of a predictions file; _NOT_AN_INPUT for a line that has none
    (not UTF-8, not a JSON object, longer than any line infer writes)."""
    for raw in infer_inputs.raw_lines(f, max_bytes=_MAX_LINE_BYTES):
        if raw is None:
            yield _NOT_AN_INPUT
            return
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            row = None
        yield row.get("input", _NOT_AN_INPUT) if isinstance(row, dict) else _NOT_AN_INPUT


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
    settings: decoding_settings.DecodingSettings,
    inputs: Iterable[str],
    exact_inputs: bool = False,
) -> str:
    """Where the predictions of `inputs` at `step` go in `folder` (see the module docstring)."""
    name = file_name(source, step, num_examples, settings, exact_inputs)
    return own_file(os.path.join(folder, name), inputs)


def json_line(
    text: str,
    prediction: str | list[str],
    target: str | None = None,
    *,
    model_input: str | None = None,
    scores: list[float] | None = None,
) -> str:
    """One line of a predictions file: {"input", "prediction"}, "target" when known, and
    "model_input" (the input as the model's task shaped it) when the inputs were shaped; with
    beam search's n best, "prediction" lists them, best first, and "scores" their summed
    log-probabilities."""
    row = {"input": text}
    if model_input is not None:
        row["model_input"] = model_input
    row["prediction"] = prediction
    if scores is not None:
        row["scores"] = scores
    if target is not None:
        row["target"] = target
    return json.dumps(row, ensure_ascii=False) + "\n"
