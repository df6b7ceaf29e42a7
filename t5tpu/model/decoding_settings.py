"""How to decode, described once: DecodingSettings, each option's rule, and the one check every
front end applies (gin's macros, the Python API's keywords, serve's parameters; the engine runs
what passes).

Names are Hugging Face's `generate` arguments where it has the option, T5X's where only T5X has
it (`beam_alpha`, T5X's brevity penalty, beside HF's `length_penalty` exponent). A front end
spells a name its own way (gin: TOP_P; serve: parameter top_p) through `check`'s `name`; the
only other spellings are ALIASES (serve's and predict's earlier `max_length`) and gin's
`random_seed` (T5X's name, GIN_NAMES).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from t5tpu import validators
from t5tpu.errors import UserError

# Sampling temperatures a float32 program divides by without overflow or a zero: 0 is greedy.
TEMPERATURES = (1e-6, 1e6)
# Repetition penalties a float32 program multiplies and divides logits by without overflow.
PENALTIES = (1e-3, 1e3)
# T5X's beam alpha and Hugging Face's length_penalty exponent, within what float32 normalizes.
BEAM_ALPHAS = (0.0, 10.0)
LENGTH_PENALTIES = (-10.0, 10.0)
# Beam search holds num_beams hypotheses per row: a bound keeps one call from asking for a
# batch many times the compiled one.
MAX_NUM_BEAMS = 16
MAX_SEED = 2**31 - 1
# Token counts within int32 (the programs' row values) and far above any output decoded here.
MAX_TOKENS = 65_536
# Earlier names a front end still takes, each for the option it names now.
ALIASES = {"max_length": "max_new_tokens"}
# Where a runner's gin argument is not the option's name (infer.random_seed, T5X's).
GIN_NAMES = {"seed": "random_seed"}


@dataclasses.dataclass(frozen=True)
class DecodingSettings:
    """How to pick each next token: greedy (temperature 0), sampling (temperature > 0, from the
    top_k most likely tokens and the smallest set whose probability reaches top_p, in Hugging
    Face's order), or beam search (num_beams > 1, T5X's length penalty beam_alpha, or Hugging
    Face's length_penalty where that is set). Greedy and sampling also take Hugging Face's
    repetition_penalty, no_repeat_ngram_size and min_new_tokens, applied before the
    temperature as its logits processors are; beam search returns its num_return_sequences
    best, sampling as many samples. `seed` feeds sampling only. Greedy's and sampling's
    values are each row's own inputs of the programs: one program decodes rows of any."""

    temperature: float = 0.0
    top_k: int = 0
    num_beams: int = 1
    beam_alpha: float = 0.6
    seed: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    min_new_tokens: int = 0
    num_return_sequences: int = 1
    # A row's own length limit within its program's (None: the program's): a value, not a
    # program's constant, so a server's requests of any length share programs.
    max_new_tokens: int | None = None
    # Hugging Face's beam length normalization, length ** length_penalty, with its stopping
    # rule, in place of T5X's beam_alpha (None: T5X's). Like beam_alpha, unused by greedy.
    length_penalty: float | None = None

    @property
    def samples(self) -> bool:
        return self.num_beams == 1 and self.temperature > 0

    @property
    def penalizes(self) -> bool:
        ngrams, least = self.no_repeat_ngram_size, self.min_new_tokens
        return self.repetition_penalty != 1 or ngrams > 0 or least > 0

    def check(
        self,
        vocab_size: int,
        *,
        longest: int | None = None,
        name: Callable[[str], str] = str.upper,
        shown: Callable[[object], str] = repr,
    ) -> None:
        """Refuses a value outside its option's rule (OPTIONS), TOP_K above the vocabulary,
        MAX_NEW_TOKENS above `longest` (the program's length), and combinations that would be
        silently ignored: beam search is deterministic (no temperature, top_k or top_p) and
        takes no penalties; num_return_sequences are beam search's n best. `name` spells an
        option as the caller's user wrote it, `shown` a value. TOP_K or TOP_P with temperature
        0 is allowed: greedy is the limit of such sampling as the temperature goes to 0."""
        for option, rule in OPTIONS.items():
            value = getattr(self, option)
            if not rule.accepts(value):
                raise UserError(rule.message(name(option), value, shown=shown))
        bounds = {"top_k": vocab_size, "max_new_tokens": longest}
        why = {
            "top_k": f"the vocabulary size ({vocab_size})",
            "max_new_tokens": f"the longest output decoded ({longest})",
        }
        if self.num_beams > 1:  # n best of the beams; with sampling, n samples
            bounds["num_return_sequences"] = self.num_beams
            why["num_return_sequences"] = f"{name('num_beams')} ({self.num_beams})"
        elif not self.samples:
            bounds["num_return_sequences"] = 1
            why["num_return_sequences"] = (
                f"1 with greedy decoding, which has one answer; set {name('temperature')} "
                f"above 0 for samples, or {name('num_beams')} above 1 for the n best"
            )
        for option, bound in bounds.items():
            value = getattr(self, option)
            if bound is not None and value is not None and value > bound:
                raise UserError(f"{name(option)} = {shown(value)} must be at most {why[option]}")
        if self.num_beams > 1:
            self._check_beam(name=name)

    def _check_beam(self, *, name: Callable[[str], str]) -> None:
        sampling = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
        penalties = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": 0}
        for unused, what in ((sampling, "does not sample"), (penalties, "takes no penalties")):
            given = [option for option, off in unused.items() if getattr(self, option) != off]
            if given:
                offs = ", ".join(f"{name(option)} = {off}" for option, off in unused.items())
                raise UserError(
                    f"{name('num_beams')} = {self.num_beams} is beam search, which {what}, so "
                    f"{name(given[0])} would be ignored; leave {offs}, or set "
                    f"{name('num_beams')} = 1"
                )


def _temperature() -> validators.Rule:
    low, high = TEMPERATURES
    sampling = validators.number(low=low, high=high)
    return validators.Rule(
        lambda value: (validators.is_number(value) and value == 0) or sampling.accepts(value),
        f"0.0 (greedy) or a number from {low:g} to {high:g} (sampling)",
    )


def _explained(rule: validators.Rule, note: str) -> validators.Rule:
    return validators.Rule(rule.accepts, f"{rule.wanted} ({note})")


# Each option's values, for every front end: the one description of what a setting may be.
OPTIONS: Mapping[str, validators.Rule] = {
    "temperature": _temperature(),
    "top_k": _explained(validators.whole(0), "0: no limit"),
    "num_beams": _explained(validators.whole(1, MAX_NUM_BEAMS), "1: greedy or sampling"),
    "beam_alpha": _explained(validators.number(low=0, high=BEAM_ALPHAS[1]), "T5X's"),
    "seed": validators.whole(0, MAX_SEED),
    "top_p": _explained(validators.number(above=0, high=1), "1.0: no limit"),
    "repetition_penalty": _explained(
        validators.number(low=PENALTIES[0], high=PENALTIES[1]), "1.0: none"
    ),
    "no_repeat_ngram_size": _explained(validators.whole(0, MAX_TOKENS), "0: off"),
    "min_new_tokens": validators.whole(0, MAX_TOKENS),
    "num_return_sequences": _explained(
        validators.whole(1, MAX_NUM_BEAMS), "beam search's n best, or as many samples"
    ),
    "max_new_tokens": validators.optional(validators.whole(1, MAX_TOKENS)),
    "length_penalty": _explained(
        validators.optional(validators.number(low=LENGTH_PENALTIES[0], high=LENGTH_PENALTIES[1])),
        "Hugging Face's exponent; None: T5X's beam_alpha",
    ),
}
NAMES = tuple(field.name for field in dataclasses.fields(DecodingSettings))
assert set(OPTIONS) == set(NAMES), "every option has its rule"


def given(values: Mapping, defaults: DecodingSettings) -> DecodingSettings:
    """`defaults` with the options `values` names (by NAMES or ALIASES; others ignored), not
    checked: the caller checks with its own spelling."""
    chosen = {name: values[name] for name in NAMES if name in values}
    for alias, option in ALIASES.items():
        if alias in values:
            if option in values:
                raise UserError(f"give {option} or {alias} (its earlier name), not both")
            chosen[option] = values[alias]
    return dataclasses.replace(defaults, **chosen)


def as_given(values: Mapping, spell: Callable[[str], str]) -> Callable[[str], str]:
    """`check`'s `name` for options given as `values`: each spelled by `spell` under the name
    it was given by (an alias, where one was used)."""
    used = {option: alias for alias, option in ALIASES.items() if alias in values}
    return lambda option: spell(used.get(option, option))


def of_arguments(arguments: dict) -> DecodingSettings:
    """The settings a runner's arguments (infer's, evaluate's: their `locals()`) name, by the
    options' gin names; others at their defaults."""
    spelled = {name: GIN_NAMES.get(name, name) for name in NAMES}
    return DecodingSettings(**{n: arguments[a] for n, a in spelled.items() if a in arguments})
