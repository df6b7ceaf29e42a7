"""A run record (storage/run_record.py) in a Hugging Face directory's own fields, so that
transformers answers as t5tpu does, and read back from them:

- config.json `prefix`: text_to_text's INPUT_PREFIX, which pipeline("text2text-generation")
  puts before every input, as t5tpu does;
- generation_config.json: the run's decoding (greedy, or beams, or sampling) up to its target
  length (`max_new_tokens`), which `generate` uses by default;
- config.json `task_specific_params["text2text-generation"]`: the same decoding, which that
  pipeline applies over its own defaults (4 beams, 256 new tokens) as the generation config is
  not;
- tokenizer_config.json `model_max_length`: the run's input length, which the tokenizer cuts
  to with `truncation=True` (EOS kept, as t5tpu cuts);
- config.json `t5tpu_run`: the whole record, which t5tpu.load reads back exactly.

Quora's lower-casing has no Hugging Face field (a tokenizer that lower-cased would lower-case
the <SEP> separator too), nor has T5X's beam length penalty: `notes` says so for an export.
"""

from __future__ import annotations

from t5tpu import validators
from t5tpu.storage import run_record
from t5tpu.storage.run_record import RunRecord

RECORD_KEY = "t5tpu_run"
PIPELINE_TASK = "text2text-generation"
# T5's ids: 0 pads and starts the decoder, 1 ends a sequence.
_IDS = {"decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}
# What transformers' T5 tokenizer cuts to when nothing says otherwise.
DEFAULT_MODEL_MAX_LENGTH = 512


def config_fields(record: RunRecord | None) -> dict:
    """The fields config.json gets beside the geometry."""
    if record is None:
        return {}
    decoding = {k: v for k, v in generation_config(record).items() if k not in _IDS}
    fields = {RECORD_KEY: record.record(), "task_specific_params": {PIPELINE_TASK: decoding}}
    if record.shaping.kind == run_record.PREFIX and record.shaping.prefix:
        fields["prefix"] = record.shaping.prefix
    return fields


def generation_config(record: RunRecord | None) -> dict:
    """generation_config.json: T5's ids, and the run's decoding up to its target length."""
    if record is None:
        return dict(_IDS)
    decoding = record.decoding
    fields = {**_IDS, "max_new_tokens": record.target_length, "num_beams": decoding.num_beams}
    sampling = decoding.num_beams == 1 and decoding.temperature > 0
    fields["do_sample"] = sampling
    if sampling:
        fields.update(temperature=decoding.temperature, top_k=decoding.top_k, top_p=decoding.top_p)
    penalties = {
        "repetition_penalty": (decoding.repetition_penalty, 1.0),
        "no_repeat_ngram_size": (decoding.no_repeat_ngram_size, 0),
        "min_new_tokens": (decoding.min_new_tokens, 0),
        "num_return_sequences": (decoding.num_return_sequences, 1),
    }
    fields.update((name, value) for name, (value, off) in penalties.items() if value != off)
    if decoding.num_beams > 1 and decoding.length_penalty is not None:
        fields.update(length_penalty=decoding.length_penalty, early_stopping=False)
    elif decoding.num_beams > 1 and decoding.beam_alpha == 0:
        fields["length_penalty"] = 0.0  # both rank by log-likelihood alone: the same beams
    return fields


def model_max_length(record: RunRecord | None) -> int:
    return record.input_length if record else DEFAULT_MODEL_MAX_LENGTH


def notes(record: RunRecord | None) -> list[str]:
    """What the export cannot carry in transformers' fields, for the command's output."""
    if record is None:
        return []
    found = []
    if record.shaping.kind == run_record.QUORA and record.shaping.normalize:
        found.append(
            "the run lower-cased its questions and dropped double quotes, which transformers "
            "does not do: lower-case inputs before the pipeline"
        )
    hf_rule = record.decoding.length_penalty is not None
    if record.decoding.num_beams > 1 and record.decoding.beam_alpha != 0 and not hf_rule:
        found.append(
            f"beam search's length penalty is T5X's (alpha {record.decoding.beam_alpha:g}); "
            "transformers' length_penalty is another formula, so its beams may differ"
        )
    return found


def record_from_files(
    config: dict, generation: dict, tokenizer: dict, *, where: str
) -> RunRecord | None:
    """The record a directory's config files carry: t5tpu's own, else what transformers'
    fields say (a prefix, a max_new_tokens, a model_max_length), else None."""
    if isinstance(config.get(RECORD_KEY), dict):
        return RunRecord.from_record(config[RECORD_KEY], where)
    prefix = config.get("prefix")
    new_tokens = generation.get("max_new_tokens")
    input_length = tokenizer.get("model_max_length")
    if not isinstance(prefix, str) and not validators.is_whole(new_tokens):
        return None
    shaping = run_record.InputShaping(run_record.PREFIX, prefix=prefix)
    return RunRecord(
        task=None,
        tasks=(),
        input_length=input_length if _fits(input_length) else DEFAULT_MODEL_MAX_LENGTH,
        target_length=new_tokens if _fits(new_tokens) else 128,
        shaping=shaping if isinstance(prefix, str) and prefix else run_record.InputShaping(),
    )


def _fits(length) -> bool:
    # Tokenizers that set no limit write a huge model_max_length (int(1e30)).
    return validators.is_whole(length, low=1, high=1 << 20)
