"""The line of an eval example in eval_examples/<task>-<step>.jsonl (runners/eval_examples.py
describes the file), built from its texts: the seqio evaluator's logger and the evaluation of a
prepared file (runners/prepared_eval.py, without seqio) write the same lines."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

# The model outputs (seqio's names) a line carries; "output" (the text before the task's
# postprocessor) and auxiliary values are left out.
OUTPUTS = ("prediction", "score")


def plain(value: Any) -> Any:
    """What json cannot write itself, as JSON: a postprocessor may return numpy values or bytes."""
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def line(*, input_text: str, target_text: str, target: Any, outputs: Mapping[str, Any]) -> str:
    """One example's JSON line: its input and target texts, `target` as postprocessed for the
    metrics (shown as "references" where it is not the target text) and its `outputs`."""
    row = {"input": input_text, "target": target_text}
    row.update((name, outputs[name]) for name in OUTPUTS if name in outputs)
    # Round-tripped so that a reference of numpy values compares with the text as JSON does.
    references = json.loads(json.dumps(target, default=plain))
    if references != row["target"]:
        row["references"] = references
    return json.dumps(row, ensure_ascii=False, default=plain) + "\n"
