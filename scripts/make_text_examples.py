"""Writes the synthetic translation and summarization samples t5tpu ships for its CPU smoke runs.

Nothing here is real data (nothing can be downloaded where these were made): both are built
from templates with a fixed seed, so re-running this script gives identical files.

- examples/translation/{train,validation}.tsv: short English sentences and their German
  translations ("The old dog sees the red cat today." -> "Der alte Hund sieht heute die rote
  Katze."), with German's noun genders, nominative/accusative articles, weak adjective endings
  and verb-second word order. Words are ASCII (no umlauts or sharp s): the bundled 1,024-piece
  vocabulary, trained on English Quora questions, has no piece for "ä" or "ß" (they decode as
  unknown), so words that need them are left out.
- examples/summarization/{train,validation}.jsonl: three- to four-sentence news paragraphs
  ("document") and a headline built from their facts ("summary"), as in XSum's fields.

No validation row repeats a training row.

    python scripts/make_text_examples.py [--out_dir DIR]
"""

import argparse
import json
import os
import random

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT_DIR = os.path.join(PROJECT_ROOT, "examples")
SEED = 20240601
TRANSLATION_ROWS = {"train": 400, "validation": 64}
SUMMARIZATION_ROWS = {"train": 240, "validation": 48}

# ----- English -> German ------------------------------------------------------------------------

# English noun -> (German noun, gender).
NOUNS = {
    "dog": ("Hund", "m"),
    "bird": ("Vogel", "m"),
    "fish": ("Fisch", "m"),
    "man": ("Mann", "m"),
    "teacher": ("Lehrer", "m"),
    "uncle": ("Onkel", "m"),
    "friend": ("Freund", "m"),
    "wolf": ("Wolf", "m"),
    "fox": ("Fuchs", "m"),
    "doctor": ("Arzt", "m"),
    "cat": ("Katze", "f"),
    "mouse": ("Maus", "f"),
    "woman": ("Frau", "f"),
    "cow": ("Kuh", "f"),
    "sister": ("Schwester", "f"),
    "duck": ("Ente", "f"),
    "goat": ("Ziege", "f"),
    "owl": ("Eule", "f"),
    "horse": ("Pferd", "n"),
    "child": ("Kind", "n"),
    "sheep": ("Schaf", "n"),
    "pig": ("Schwein", "n"),
    "rabbit": ("Kaninchen", "n"),
    "camel": ("Kamel", "n"),
}
ADJECTIVES = {
    "red": "rot",
    "small": "klein",
    "old": "alt",
    "young": "jung",
    "fast": "schnell",
    "brown": "braun",
    "black": "schwarz",
    "clever": "klug",
    "wild": "wild",
    "quiet": "ruhig",
}
# Each takes an accusative object.
VERBS = {
    "sees": "sieht",
    "finds": "findet",
    "meets": "trifft",
    "draws": "zeichnet",
    "loves": "liebt",
    "calls": "ruft",
    "asks": "fragt",
    "watches": "beobachtet",
    "looks for": "sucht",
    "visits": "besucht",
    "chases": "jagt",
    "paints": "malt",
}
# English adverbial -> (German, whether English puts it before the verb). German puts each
# right after the verb (verb second), before the object.
ADVERBS = {
    "today": ("heute", False),
    "every day": ("jeden Tag", False),
    "in the evening": ("am Abend", False),
    "often": ("oft", True),
}
ARTICLES = {
    ("nominative", "m"): "der",
    ("nominative", "f"): "die",
    ("nominative", "n"): "das",
    ("accusative", "m"): "den",
    ("accusative", "f"): "die",
    ("accusative", "n"): "das",
}


def _german_phrase(noun: str, adjective: str | None, case: str) -> str:
    """'den alten Hund': the definite article, then the adjective's weak ending (-en for a
    masculine accusative, else -e), then the noun."""
    german, gender = NOUNS[noun]
    words = [ARTICLES[(case, gender)]]
    if adjective:
        ending = "en" if (case, gender) == ("accusative", "m") else "e"
        words.append(ADJECTIVES[adjective] + ending)
    words.append(german)
    return " ".join(words)


def _english_phrase(noun: str, adjective: str | None) -> str:
    return " ".join(["the", *([adjective] if adjective else []), noun])


def translation_pair(rng: random.Random) -> tuple[str, str]:
    """One English sentence and its German translation."""
    subject, obj = rng.sample(sorted(NOUNS), 2)
    subject_adj, object_adj = (rng.choice([None, *sorted(ADJECTIVES)]) for _ in range(2))
    verb = rng.choice(sorted(VERBS))
    adverb = rng.choice([None, None, *sorted(ADVERBS)])
    english = [_english_phrase(subject, subject_adj), verb, _english_phrase(obj, object_adj)]
    german = [_german_phrase(subject, subject_adj, "nominative"), VERBS[verb]]
    if adverb:
        german_adverb, before_verb = ADVERBS[adverb]
        english.insert(1 if before_verb else 3, adverb)
        german.append(german_adverb)
    german.append(_german_phrase(obj, object_adj, "accusative"))
    return _sentence(english), _sentence(german)


def _sentence(words: list[str]) -> str:
    text = " ".join(words)
    return text[0].upper() + text[1:] + "."


# ----- news paragraphs -> headlines -------------------------------------------------------------

CITIES = [
    "Bristol", "Leeds", "Denver", "Austin", "Portland", "Glasgow", "Dublin", "Boston",
    "Cardiff", "Toronto", "Phoenix", "Seattle", "Oxford", "York", "Dallas", "Chicago",
]  # fmt: skip
PEOPLE = [
    "Anna Carter", "John Miller", "Maria Lopez", "David Brown", "Sarah Lee", "Peter Wood",
    "Emma Clark", "James Hill", "Laura King", "Tom Baker", "Lucy Green", "Mark Evans",
]  # fmt: skip
COMPANIES = [
    "Northwind", "Bluepeak", "Redstone", "Silverline", "Greenfield", "Oakridge", "Brightwater",
    "Ironbridge",
]  # fmt: skip
PRODUCTS = ["phones", "cars", "shoes", "games", "software", "furniture", "coffee", "bicycles"]
FACILITIES = ["library", "stadium", "bridge", "hospital", "school", "park", "museum", "airport"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
WEATHER = ["rain", "snow", "wind"]


def _match(rng: random.Random) -> tuple[list[str], str]:
    home, away = rng.sample(CITIES, 2)
    won, lost = rng.randint(2, 5), rng.randint(0, 1)
    player, coach = rng.sample(PEOPLE, 2)
    return [
        f"{home} beat {away} {won} to {lost} on {rng.choice(DAYS)} in front of "
        f"{rng.randint(5, 60)},000 fans.",
        f"{player} scored {rng.randint(1, won)} of the {won} goals for {home}.",
        f"The {away} coach, {coach}, said his team had played badly.",
        f"{home} will play again next week.",
    ], f"{home} beat {away} {won} to {lost}"


def _council(rng: random.Random) -> tuple[list[str], str]:
    city, facility, mayor = rng.choice(CITIES), rng.choice(FACILITIES), rng.choice(PEOPLE)
    approved = rng.random() < 0.5
    votes = sorted(rng.sample(range(1, 10), 2), reverse=approved)
    decision = "approve" if approved else "reject"
    cost = "is expected to cost" if approved else "would have cost"
    return [
        f"The {city} council voted on {rng.choice(DAYS)} to {decision} plans for a new {facility}.",
        f"Members voted {votes[0]} to {votes[1]} after a long debate.",
        f"The {facility} {cost} {rng.randint(2, 90)} million dollars.",
        f"Mayor {mayor} said the city would listen to everyone.",
    ], f"{city} council {decision}s new {facility}"


def _profit(rng: random.Random) -> tuple[list[str], str]:
    company, chief = rng.choice(COMPANIES), rng.choice(PEOPLE)
    change, percent = rng.choice(["rose", "fell"]), rng.randint(2, 40)
    verb = "rises" if change == "rose" else "falls"
    return [
        f"{company} said on {rng.choice(DAYS)} that its profit {change} by {percent} percent "
        "last year.",
        f"The company, which makes {rng.choice(PRODUCTS)}, employs {rng.randint(2, 90)},000 "
        "people.",
        f"Its chief executive, {chief}, said the coming year would be difficult.",
    ], f"{company} profit {verb} {percent} percent"


def _storm(rng: random.Random) -> tuple[list[str], str]:
    city, weather = rng.choice(CITIES), rng.choice(WEATHER)
    return [
        f"A storm brought heavy {weather} to {city} on {rng.choice(DAYS)}.",
        f"About {rng.randint(2, 90)},000 homes lost power and several roads were closed.",
        f"{rng.choice(PEOPLE)}, who lives in {city}, said it was the worst storm in years.",
    ], f"Storm brings heavy {weather} to {city}"


STORIES = (_match, _council, _profit, _storm)


def summarization_pair(rng: random.Random) -> tuple[str, str]:
    """A news paragraph (its lead sentence first, the others in random order) and its headline."""
    sentences, headline = rng.choice(STORIES)(rng)
    rest = sentences[1:]
    rng.shuffle(rest)
    return " ".join([sentences[0], *rest]), headline


# ----- files --------------------------------------------------------------------------------


def unique_pairs(make, rng: random.Random, counts: dict[str, int]) -> dict[str, list]:
    """`counts[split]` distinct pairs per split, no input in two splits."""
    seen, splits = set(), {}
    for split, count in counts.items():
        rows = []
        while len(rows) < count:
            pair = make(rng)
            if pair[0] not in seen:
                seen.add(pair[0])
                rows.append(pair)
        splits[split] = rows
    return splits


def write_tsv(path: str, rows: list[tuple[str, str]]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write("input\ttarget\n")
        f.writelines(f"{source}\t{target}\n" for source, target in rows)


def write_jsonl(path: str, rows: list[tuple[str, str]]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(json.dumps({"document": d, "summary": s}) + "\n" for d, s in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out_dir", default=DEFAULT_OUT_DIR, help="where the two folders go")
    args = parser.parse_args()
    rng = random.Random(SEED)
    samples = [
        ("translation", translation_pair, TRANSLATION_ROWS, write_tsv, "tsv"),
        ("summarization", summarization_pair, SUMMARIZATION_ROWS, write_jsonl, "jsonl"),
    ]
    for folder, make, counts, write, suffix in samples:
        os.makedirs(os.path.join(args.out_dir, folder), exist_ok=True)
        for split, rows in unique_pairs(make, rng, counts).items():
            path = os.path.join(args.out_dir, folder, f"{split}.{suffix}")
            write(path, rows)
            print(f"{path}: {len(rows)} rows")


if __name__ == "__main__":
    main()
