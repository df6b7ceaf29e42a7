"""Metrics over postprocessed text labels, in the (targets, predictions) -> dict form seqio calls.

Values are percentages, as T5 reports them.
"""

from collections.abc import Sequence

from t5tpu.tasks import squad_metrics

POSITIVE_LABEL = "1"
NEGATIVE_LABEL = "0"


def accuracy(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
    """Percentage of predictions equal to their target."""
    _check_lengths(targets, predictions)
    correct = sum(t == p for t, p in zip(targets, predictions, strict=True))
    return {"accuracy": 100.0 * correct / len(targets) if targets else 0.0}


def f1_duplicate(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
    """F1 of the duplicate class ("1"), as a percentage.

    A prediction that is neither "0" nor "1" (a model early in training may write anything)
    counts as the wrong label: a miss on a duplicate, a false alarm on a non-duplicate.
    """
    _check_lengths(targets, predictions)
    labels = [_as_label(t, p) for t, p in zip(targets, predictions, strict=True)]
    true_pos = sum(t == POSITIVE_LABEL and p == POSITIVE_LABEL for t, p in labels)
    false_pos = sum(t != POSITIVE_LABEL and p == POSITIVE_LABEL for t, p in labels)
    false_neg = sum(t == POSITIVE_LABEL and p != POSITIVE_LABEL for t, p in labels)
    # With no duplicates predicted or present F1 is undefined; 0 keeps the metric a number.
    if true_pos == 0:
        return {"f1_duplicate": 0.0}
    return {"f1_duplicate": 100.0 * 2 * true_pos / (2 * true_pos + false_pos + false_neg)}


def exact_match(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
    """Percentage of predictions identical to their target text."""
    _check_lengths(targets, predictions)
    matches = sum(t == p for t, p in zip(targets, predictions, strict=True))
    return {"exact_match": 100.0 * matches / len(targets) if targets else 0.0}


def bleu(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
    """Corpus BLEU (sacrebleu's defaults: 13a tokenization, exponential smoothing), one
    reference per prediction, on the 0-100 scale sacrebleu reports."""
    _check_lengths(targets, predictions)
    if not targets:
        return {"bleu": 0.0}
    # Imported when BLEU is asked for: the gin files' configurables import this module, and a
    # machine that only benchmarks (scripts/accelerator_check.sh) need not have sacrebleu.
    import sacrebleu

    return {"bleu": sacrebleu.corpus_bleu(list(predictions), [list(targets)]).score}


def token_f1(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
    """Mean word-overlap F1 of each prediction with its target, after SQuAD's normalization
    (lower case, no punctuation or articles)."""
    _check_lengths(targets, predictions)
    scores = [squad_metrics.token_f1(p, t) for t, p in zip(targets, predictions, strict=True)]
    return {"f1": 100.0 * sum(scores) / len(scores) if scores else 0.0}


ROUGE_TYPES = ("rouge1", "rouge2", "rougeLsum")


def rouge(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
    """Mean ROUGE-1, ROUGE-2 and ROUGE-Lsum F-measures (Google's rouge-score, with stemming,
    as T5's summarization results use), one reference per prediction."""
    _check_lengths(targets, predictions)
    from rouge_score import rouge_scorer  # 0.7 s to import (nltk): only when ROUGE is asked for

    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    totals = dict.fromkeys(ROUGE_TYPES, 0.0)
    for target, prediction in zip(targets, predictions, strict=True):
        scores = scorer.score(target, prediction)
        for kind in ROUGE_TYPES:
            totals[kind] += scores[kind].fmeasure
    count = max(len(targets), 1)
    return {kind: 100.0 * total / count for kind, total in totals.items()}


def _as_label(target: str, prediction: str) -> tuple[str, str]:
    """(target, prediction) with an invalid prediction replaced by the label opposite the target."""
    if prediction in (POSITIVE_LABEL, NEGATIVE_LABEL):
        return target, prediction
    wrong = NEGATIVE_LABEL if target == POSITIVE_LABEL else POSITIVE_LABEL
    return target, wrong


def _check_lengths(targets: Sequence[str], predictions: Sequence[str]) -> None:
    if len(targets) != len(predictions):
        raise ValueError(f"{len(targets)} targets but {len(predictions)} predictions")
