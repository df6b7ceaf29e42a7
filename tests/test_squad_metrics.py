"""SQuAD exact match and F1 against values computed by hand, on real dev-set questions.

Gold answers are read from ../shared/data; v2.0 questions are found by their text, since the
CS224N split has its own ids. Each expected F1 is worked out in a comment from the official rules:
normalize (lower case, drop punctuation, drop a/an/the, collapse spaces), then
F1 = 2PR/(P+R) over shared tokens, best over the gold answers.
"""

import json
import os

import pytest
from t5tpu.tasks import squad, squad_metrics

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared")
V1_FILE = os.path.join(DATA, "data", "squad", "dev-v1.1.json")
V2_FILE = os.path.join(DATA, "data", "squad", "dev-v2.0-cs224n-part-a.json")


def _gold_answers(path, key):
    """{qa[key]: gold answer texts} over every question of an official SQuAD file."""
    with open(path, encoding="utf-8") as f:
        articles = json.load(f)["data"]
    return {
        qa[key]: [a["text"] for a in qa["answers"]]
        for article in articles
        for paragraph in article["paragraphs"]
        for qa in paragraph["qas"]
    }


@pytest.fixture(scope="module")
def v1():
    # By the official ids: some question texts repeat (with other gold answers).
    return _gold_answers(V1_FILE, "id")


@pytest.fixture(scope="module")
def v2():
    return _gold_answers(V2_FILE, "question")


def test_normalization_follows_the_official_rules():
    assert squad_metrics.normalize_answer("  The  Denver Broncos. ") == "denver broncos"
    # Punctuation is deleted, not replaced by a space: "gold-themed" is one token.
    assert squad_metrics.normalize_answer("gold-themed") == "goldthemed"
    # Articles go only as whole words ("theme" keeps its "the"), after punctuation is gone.
    assert squad_metrics.normalize_answer("A theme, an Anthem; THE end") == "theme anthem end"
    assert squad_metrics.normalize_answer("Levi's Stadium") == "levis stadium"


def test_v1_gold_answers_score_100(v1):
    questions = [
        "56be4db0acb8001400a502ec",  # Which NFL team represented the AFC at Super Bowl 50?
        "56be4db0acb8001400a502ee",  # Where did Super Bowl 50 take place?
        "56be8e613aeaaa14008c90d1",  # What was the theme of Super Bowl 50?
    ]
    targets = [v1[q] for q in questions]
    for i in range(3):  # every one of the annotators' answers is a perfect prediction
        predictions = [golds[i] for golds in targets]
        assert squad_metrics.squad_v1(targets, predictions) == {"exact_match": 100.0, "f1": 100.0}


def test_v1_wrong_and_partial_answers(v1):
    # Which NFL team represented the AFC at Super Bowl 50?
    bowl_team = v1["56be4db0acb8001400a502ec"]
    assert bowl_team == ["Denver Broncos"] * 3
    # Where did Super Bowl 50 take place?
    place = v1["56be4db0acb8001400a502ee"]
    assert place == [
        "Santa Clara, California",
        "Levi's Stadium",
        "Levi's Stadium in the San Francisco Bay Area at Santa Clara, California.",
    ]
    # What was the theme of Super Bowl 50?
    theme = v1["56be8e613aeaaa14008c90d1"]
    assert theme == ['"golden anniversary"', "gold-themed", '"golden anniversary']

    def one(golds, prediction):
        return squad_metrics.squad_v1([golds], [prediction])

    # "the Denver Broncos." normalizes to the gold "denver broncos".
    assert one(bowl_team, "the Denver Broncos.") == {"exact_match": 100.0, "f1": 100.0}
    # [broncos] vs [denver, broncos]: shared 1, P = 1/1, R = 1/2, F1 = 2(1)(1/2)/(3/2) = 2/3.
    assert one(bowl_team, "Broncos")["f1"] == pytest.approx(200 / 3)
    assert one(bowl_team, "Broncos")["exact_match"] == 0.0
    # [levis, stadium, in, santa, clara] (5 tokens) against
    #   [santa, clara, california]: shared 2, P = 2/5, R = 2/3, F1 = 0.5
    #   [levis, stadium]: shared 2, P = 2/5, R = 1, F1 = 0.8/1.4 = 4/7
    #   [levis, stadium, in, san, francisco, bay, area, at, santa, clara, california] (11):
    #     shared 5, P = 1, R = 5/11, F1 = (10/11)/(16/11) = 5/8   <- the best
    assert one(place, "Levi's Stadium in Santa Clara")["f1"] == pytest.approx(62.5)
    # [gold, themed] shares nothing with [goldthemed] or [golden, anniversary]: F1 0.
    assert one(theme, "gold themed") == {"exact_match": 0.0, "f1": 0.0}
    assert one(theme, "goldthemed") == {"exact_match": 100.0, "f1": 100.0}
    # [golden, anniversary, celebration] vs [golden, anniversary]: P = 2/3, R = 1, F1 = 0.8.
    assert one(theme, "the golden anniversary celebration")["f1"] == pytest.approx(80.0)

    # Over the three: EM (0 + 0 + 1)/3; F1 (2/3 + 5/8 + 1)/3 = 0.763888...
    totals = squad_metrics.squad_v1(
        [bowl_team, place, theme], ["Broncos", "Levi's Stadium in Santa Clara", "goldthemed"]
    )
    assert totals["exact_match"] == pytest.approx(100 / 3)
    assert totals["f1"] == pytest.approx(100 * (2 / 3 + 5 / 8 + 1) / 3)


def test_v1_keeps_its_script_rule_for_an_answer_that_normalizes_to_nothing(v1):
    # One annotator answered ".", which normalizes to "": v1.1's script counts an empty prediction
    # as an exact match of it, but its F1 of two empty token lists is 0.
    # "What was the name of Theodore Roosevelt’s policy of imperialism?"
    golds = v1["5730b7ce069b5314008322c4"]
    assert golds == [
        "interventionism",
        ".",
        "interventionism",
        "interventionism",
        "interventionism",
    ]
    assert squad_metrics.squad_v1([golds], [""]) == {"exact_match": 100.0, "f1": 0.0}


def test_v2_breakdowns_on_answerable_and_unanswerable_questions(v2):
    located = v2["In what country is Normandy located?"]
    when = v2["When were the Normans in Normandy?"]
    gave_name = v2["Who gave their name to Normandy in the 1000's and 1100's"]
    region = v2["What is France a region of?"]
    assert located == ["France"] * 4
    assert (
        when
        == ["10th and 11th centuries", "in the 10th and 11th centuries"]
        + ["10th and 11th centuries"] * 2
    )
    assert gave_name == [] and region == []  # unanswerable in v2.0

    # "11th century" -> [11th, century] against
    #   [10th, and, 11th, centuries]: shared 1 (11th), P = 1/2, R = 1/4, F1 = (1/4)/(3/4) = 1/3
    #   [in, 10th, and, 11th, centuries]: shared 1, P = 1/2, R = 1/5, F1 = (1/5)/(7/10) = 2/7
    # The unanswerable ones: "" matches (1, 1); "Normans" does not (0, 0).
    metrics = squad_metrics.squad_v2(
        [located, when, gave_name, region], ["France", "11th century", "", "Normans"]
    )
    assert metrics == pytest.approx(
        {
            "exact": 50.0,  # (1 + 0 + 1 + 0) / 4
            "f1": 100 * (1 + 1 / 3 + 1 + 0) / 4,
            "total": 4.0,
            "HasAns_exact": 50.0,
            "HasAns_f1": 100 * (1 + 1 / 3) / 2,
            "HasAns_total": 2.0,
            "NoAns_exact": 50.0,
            "NoAns_f1": 50.0,
            "NoAns_total": 2.0,
        }
    )
    # Saying "no answer" to an answerable question scores 0 (v2's F1 of empty vs non-empty).
    assert squad_metrics.squad_v2([located], [""])["f1"] == 0.0


def test_v2_gold_answers_score_100_and_the_no_answer_target_reads_as_empty(v2):
    questions = ["Who was the Norse leader?", "Who did King Charles III swear fealty to?"]
    targets = [v2[q] for q in questions]
    assert targets == [["Rollo"] * 4, []]
    # The model writes the task's NO_ANSWER target; postprocessing turns it into "".
    predictions = [squad.postprocess_v2(" Rollo "), squad.postprocess_v2(squad.NO_ANSWER)]
    assert predictions == ["Rollo", ""]
    metrics = squad_metrics.squad_v2(targets, predictions)
    assert metrics["exact"] == metrics["f1"] == 100.0
    assert metrics["HasAns_total"] == metrics["NoAns_total"] == 1.0


def test_v2_drops_gold_answers_that_normalize_to_nothing(v2):
    # An annotator's "." is not an answer in v2.0: an empty prediction no longer matches it.
    golds = v2["Why did the Shah of Iran gave an interview?"]
    assert "." in golds and len(golds) == 4
    assert squad_metrics.squad_v2([golds], [""])["exact"] == 0.0
    assert squad_metrics.squad_v2([golds], ["renewal of hostilities"])["exact"] == 100.0


def test_v2_leaves_out_the_breakdown_of_a_kind_it_has_not_seen():
    metrics = squad_metrics.squad_v2([["Rollo"]], ["Rollo"])
    assert "HasAns_exact" in metrics and "NoAns_exact" not in metrics


def test_mismatched_lengths_and_v1_without_gold_answers_are_errors():
    with pytest.raises(ValueError, match="2 targets but 1 predictions"):
        squad_metrics.squad_v1([["a"], ["b"]], ["a"])
    with pytest.raises(ValueError, match="at least one gold answer"):
        squad_metrics.squad_v1([[]], [""])
