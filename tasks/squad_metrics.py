"""SQuAD's official exact match and F1, as seqio metric functions over postprocessed text.

The rules are those of the official evaluation scripts (v1.1 and v2.0):

- an answer is normalized before comparing: lower-cased, punctuation removed, the articles
  "a", "an", "the" removed as words, whitespace collapsed;
- exact match is 1 when the normalized prediction equals a normalized gold answer;
- F1 is over the bag of normalized tokens shared by prediction and gold answer;
- a question scores the best value over its gold answers; the totals are percentages.

v2.0 adds unanswerable questions: gold answers that normalize to nothing are dropped, and a
question left with none has the single gold answer "" (no answer), which only an empty
prediction matches (exact 1, F1 1). v1.1 has no such questions and keeps its script's F1, in which
two empty token lists share nothing (F1 0).

Targets are lists of gold answer strings (one list per question), predictions strings.
"""

import collections
import re
import string
from collections.abc import Callable, Sequence

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (the official scripts' order)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str) -> float:
    """v1.1's F1: harmonic mean of token precision and recall; 0 when nothing is shared."""
    return _overlap_f1(normalize_answer(prediction).split(), normalize_answer(gold).split())


def token_f1_v2(prediction: str, gold: str) -> float:
    """v2.0's F1: as v1.1's, except that when either side is empty it is 1 only if both are."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not predicted or not expected:
        return float(predicted == expected)
    return _overlap_f1(predicted, expected)


def _overlap_f1(predicted: list[str], expected: list[str]) -> float:
    shared = sum((collections.Counter(predicted) & collections.Counter(expected)).values())
    if shared == 0:
        return 0.0
    precision, recall = shared / len(predicted), shared / len(expected)
    return 2 * precision * recall / (precision + recall)


def best_score(score: Callable[[str, str], float], prediction: str, golds: Sequence[str]) -> float:
    """The best score of `prediction` against any of the gold answers."""
    return max(score(prediction, gold) for gold in golds)


def v2_gold_answers(answers: Sequence[str]) -> list[str]:
    """The gold answers v2.0 scores against: those that normalize to something, else [""]."""
    kept = [answer for answer in answers if normalize_answer(answer)]
    return kept or [""]


def squad_v1(targets: Sequence[Sequence[str]], predictions: Sequence[str]) -> dict[str, float]:
    """{"exact_match", "f1"} in percent, as the official v1.1 script reports them."""
    _check(targets, predictions)
    if any(not golds for golds in targets):
        raise ValueError("SQuAD v1.1 scoring needs at least one gold answer per question")
    pairs = list(zip(predictions, targets, strict=True))
    return {
        "exact_match": _percent([best_score(exact_match, p, g) for p, g in pairs]),
        "f1": _percent([best_score(token_f1, p, g) for p, g in pairs]),
    }


def squad_v2(targets: Sequence[Sequence[str]], predictions: Sequence[str]) -> dict[str, float]:
    """The official v2.0 script's totals and HasAns/NoAns breakdowns, in percent.

    A question has an answer when it has any gold answer at all (as in the script); an empty
    prediction means "no answer". Breakdowns of a kind with no questions are left out, as the
    script leaves them out.
    """
    _check(targets, predictions)
    exact, f1, has_answer = [], [], []
    for prediction, answers in zip(predictions, targets, strict=True):
        golds = v2_gold_answers(answers)
        exact.append(best_score(exact_match, prediction, golds))
        f1.append(best_score(token_f1_v2, prediction, golds))
        has_answer.append(bool(answers))
    results = {"exact": _percent(exact), "f1": _percent(f1), "total": float(len(exact))}
    for prefix, wanted in (("HasAns", True), ("NoAns", False)):
        chosen = [i for i, has in enumerate(has_answer) if has == wanted]
        if chosen:
            results[f"{prefix}_exact"] = _percent([exact[i] for i in chosen])
            results[f"{prefix}_f1"] = _percent([f1[i] for i in chosen])
            results[f"{prefix}_total"] = float(len(chosen))
    return results


def _percent(scores: Sequence[float]) -> float:
    return 100.0 * sum(scores) / len(scores) if scores else 0.0


def _check(targets: Sequence, predictions: Sequence) -> None:
    if len(targets) != len(predictions):
        raise ValueError(f"{len(targets)} targets but {len(predictions)} predictions")
