"""Every t5tpu command: its name, what it does in one line, one example, and where its code is.

`t5tpu --help` and each command's --help are printed from this table, and it is imported for
every command line, so it imports nothing heavy: the tool modules it names keep jax, TensorFlow
and seqio out of their top level, and a runner's module is named as a string, imported only once
the command line has been parsed.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from types import ModuleType

from t5tpu.cli import bench, convert, prepare_quora, serve, vertex, vertex_deploy

EXPERIMENT = "configs/experiments/qp_is_duplicate_tiny_cpu.gin"


@dataclasses.dataclass(frozen=True)
class Macro:
    """A gin macro a command reads: its default as the run file sets it ('required' for
    %gin.REQUIRED) and what it means."""

    name: str
    default: str
    meaning: str


@dataclasses.dataclass(frozen=True)
class GinCommand:
    """A command whose flags are gin files and bindings; gin supplies every argument of its
    runner, so its settings are the macros of `run_file`."""

    name: str
    summary: str
    runner: str  # "module:function"
    run_file: str
    macros: tuple[Macro, ...]
    example: str
    notes: tuple[str, ...] = ()
    compilation_cache: bool = True
    # Reads a task's data through TensorFlow: loaded quietly at start-up. The others load it,
    # quietly too, only if they come to need it (t5tpu.runtime.lazy_imports): `infer` of given
    # inputs and `plan` never do, and start sooner.
    tensorflow: bool = True
    # Parsed before the user's gin files, which rebind what they set (plan: a model gin alone
    # is enough).
    defaults_files: tuple[str, ...] = ()
    # Runs train steps: the process keeps freed host memory for the next step's temporaries
    # (runtime/host_memory.py). The others keep glibc's per-thread heaps, on which XLA's
    # compiler threads do not queue for one lock.
    trains: bool = False

    def load_runner(self) -> Callable[[], object]:
        module, function = self.runner.split(":")
        return getattr(importlib.import_module(module), function)


@dataclasses.dataclass(frozen=True)
class ToolCommand:
    """A helper command with its own argparse flags. Its module is light to import and has NAME,
    SUMMARY, EXAMPLE, parser(), parse_args(argv) and run(args) -> exit code."""

    module: ModuleType
    tensorflow: bool  # reads or writes through TensorFlow: load it quietly first
    compilation_cache: bool  # compiles JAX programs worth keeping for the next run
    trains: bool = False  # runs train steps (GinCommand.trains)

    @property
    def name(self) -> str:
        return self.module.NAME

    @property
    def summary(self) -> str:
        return self.module.SUMMARY

    @property
    def example(self) -> str:
        return self.module.EXAMPLE


_MODEL_DIR = Macro("MODEL_DIR", "required", "where checkpoints, configs, metrics, predictions go")
_TASK = Macro("MIXTURE_OR_TASK_NAME", "required", "seqio task or mixture, e.g. qp_is_duplicate")
_TASK_MODULE = Macro(
    "MIXTURE_OR_TASK_MODULE", "None", "your module or .py file that registers more tasks"
)
_LENGTHS = Macro("TASK_FEATURE_LENGTHS", "required", "{'inputs': 512, 'targets': 128}")
# eval and infer: the lengths the checkpoint's run trained with, unless told.
_RUNS_LENGTHS = dataclasses.replace(
    _LENGTHS, default="None", meaning="None: those the checkpoint's run trained with"
)
_BATCH_SIZE = Macro("BATCH_SIZE", "128", "global batch, split over the mesh's data axis")
_MICROBATCHES = Macro("NUM_MICROBATCHES", "1", "gradient accumulation: the batch in N pieces")
_PACKING = Macro("USE_PACKING", "False", "pack several examples into one row")
_EVAL_SPLIT = Macro("EVAL_SPLIT", "'validation'", "the split eval reads")
_EVAL_BATCH_SIZE = Macro("EVAL_BATCH_SIZE", "32", "eval's batch size")
_EVAL_NUM_EXAMPLES = Macro(
    "EVAL_NUM_EXAMPLES", "None", "evaluate only the first N examples (None: all)"
)
_PREPARED = Macro(
    "PREPARED_DATA", "None", "a `t5tpu prepare-data` file: train/eval from it, no TensorFlow needed"
)
_STEPS = Macro("TRAIN_STEPS", "required", "absolute step to train to; raising it continues a run")
_SEED = Macro("RANDOM_SEED", "0", "initialization, data order and dropout")
_CHECKPOINT_STEP = "'latest', 'all' or a step"
_BEAMS = (
    Macro("NUM_BEAMS", "1", "above 1: beam search"),
    Macro("BEAM_ALPHA", "0.6", "beam search's length penalty, T5X's ((5 + n) / 6) ** alpha"),
    Macro("LENGTH_PENALTY", "None", "else Hugging Face's: n ** LENGTH_PENALTY, its stopping rule"),
)

TRAIN = GinCommand(
    name="train",
    trains=True,
    summary="fine-tune (or train from scratch) a T5 model; a rerun continues from its checkpoint",
    runner="t5tpu.runners.train:train",
    run_file="configs/runs/finetune.gin",
    macros=(
        _MODEL_DIR,
        _TASK,
        _TASK_MODULE,
        _LENGTHS,
        _STEPS,
        _BATCH_SIZE,
        Macro("DROPOUT_RATE", "0.1", "dropout in every layer"),
        Macro("LEARNING_RATE", "0.001", "Adafactor's constant rate (T5's fine-tuning recipe)"),
        _PACKING,
        _SEED,
        _MICROBATCHES,
        Macro("SAVE_PERIOD", "1000", "steps between checkpoints (and one at the end)"),
        Macro("KEEP_CHECKPOINTS", "None", "keep only the newest N checkpoints"),
        Macro("KEEP_PERIOD", "None", "and also every checkpoint whose step is a multiple of K"),
        Macro("CHECKPOINT_DTYPE", "'float32'", "'bfloat16' halves checkpoints (inexact resume)"),
        Macro("EVAL_PERIOD", "0", "evaluate every N steps while training (0: never)"),
        _EVAL_SPLIT,
        _EVAL_BATCH_SIZE,
        Macro(
            "INITIAL_CHECKPOINT_PATH",
            "None",
            "pretrained weights: a checkpoint_N, Hugging Face, T5X or Mesh TF checkpoint",
        ),
        Macro(
            "FINETUNE_METHOD",
            "'full'",
            "'lora': low-rank adapters on the frozen INITIAL_CHECKPOINT_PATH (lora.rank, ...)",
        ),
        _PREPARED,
    ),
    example=(
        f"t5tpu train --gin_file={EXPERIMENT} --gin.MODEL_DIR=\"'/tmp/qp'\" --gin.TRAIN_STEPS=300"
    ),
)

EVAL = GinCommand(
    name="eval",
    summary="the task's metrics for checkpoints in MODEL_DIR, also beside a training run",
    runner="t5tpu.runners.evaluate:evaluate",
    run_file="configs/runs/eval.gin",
    macros=(
        _MODEL_DIR,
        _TASK,
        _TASK_MODULE,
        _RUNS_LENGTHS,
        Macro("CHECKPOINT_STEP", "'latest'", f"{_CHECKPOINT_STEP}, or 'continuous' while training"),
        _EVAL_SPLIT,
        _EVAL_BATCH_SIZE,
        _EVAL_NUM_EXAMPLES,
        Macro("EVAL_OUTPUT_DIR", "None", "where metrics go (None: MODEL_DIR)"),
        *_BEAMS,
        _PREPARED,
    ),
    example=f"t5tpu eval --gin_file={EXPERIMENT} --gin.MODEL_DIR=\"'/tmp/qp'\" "
    "--gin.CHECKPOINT_STEP=\"'all'\"",
)

INFER = GinCommand(
    name="infer",
    summary="decode a file of inputs, inputs given in gin, or a task split with a checkpoint",
    runner="t5tpu.runners.infer:infer",
    run_file="configs/runs/infer.gin",
    macros=(
        _MODEL_DIR,
        dataclasses.replace(_TASK, default="None", meaning="the task whose split to decode"),
        _TASK_MODULE,
        _RUNS_LENGTHS,
        Macro("CHECKPOINT_STEP", "'latest'", _CHECKPOINT_STEP),
        Macro("INFER_INPUT_FILE", "None", "text file(s), one input per line: a, b or a glob"),
        Macro("INFER_INPUTS", "None", "a list of model inputs, e.g. from the command line"),
        Macro("INFER_SPLIT", "'validation'", "the task split to decode without inputs given"),
        Macro("INFER_NUM_EXAMPLES", "None", "decode only the first N inputs (None: all)"),
        Macro("INFER_BATCH_SIZE", "32", "inputs decoded together"),
        Macro("INFER_CHUNK_SIZE", "4096", "inputs decoded and saved together; reruns resume"),
        Macro("INFER_SHARD_ID", "0", "this run's shard of INFER_NUM_SHARDS independent runs"),
        Macro("INFER_NUM_SHARDS", "1", "independent runs that split the chunks"),
        Macro("INFER_OUTPUT_DIR", "None", "where predictions go (None: MODEL_DIR)"),
        Macro("INFER_TRUNCATION", "'warn'", "long inputs: 'warn' truncates them, 'error' refuses"),
        Macro(
            "INFER_EXACT_INPUTS",
            "False",
            "True: lines are model inputs as they are, not shaped as the run's task did",
        ),
        Macro("TEMPERATURE", "0.0", "above 0: sampling instead of greedy decoding"),
        Macro("TOP_K", "0", "sample from the k most likely tokens (0: all)"),
        Macro("TOP_P", "1.0", "then from the fewest whose probability reaches p (1.0: all)"),
        Macro("REPETITION_PENALTY", "1.0", "above 1: tokens decoded already less likely"),
        Macro("NO_REPEAT_NGRAM_SIZE", "0", "n: no n-gram decoded twice (0: off)"),
        Macro("MIN_NEW_TOKENS", "0", "end-of-sequence forbidden before this many tokens"),
        Macro("NUM_RETURN_SEQUENCES", "1", "beam search's n best (or n samples) per input, scored"),
        Macro("SEED", "0", "sampling's seed (infer.random_seed); each input draws its own key"),
        *_BEAMS,
    ),
    example=f"t5tpu infer --gin_file={EXPERIMENT} --gin.MODEL_DIR=\"'/tmp/qp'\" "
    "--gin.INFER_INPUT_FILE=\"'examples/questions.txt'\"",
    notes=("predictions go to MODEL_DIR/inference/<source>-<step>.jsonl (or INFER_OUTPUT_DIR's)",),
    tensorflow=False,
)

PREPARE_DATA = GinCommand(
    name="prepare-data",
    summary="a run's batches and eval examples in one file, for a machine without TensorFlow",
    runner="t5tpu.runners.prepare_data:prepare_data",
    run_file="configs/runs/prepare_data.gin",
    defaults_files=("configs/runs/prepare_data.gin",),
    macros=(
        dataclasses.replace(_PREPARED, default="required", meaning="the .npz file to write"),
        _TASK,
        _TASK_MODULE,
        _LENGTHS,
        dataclasses.replace(_STEPS, meaning="the batches written: those of TRAIN_STEPS steps"),
        _BATCH_SIZE,
        _PACKING,
        _SEED,
        _EVAL_SPLIT,
        _EVAL_NUM_EXAMPLES,
    ),
    example=f"t5tpu prepare-data --gin_file={EXPERIMENT} --gin.TRAIN_STEPS=300 "
    "--gin.PREPARED_DATA=\"'/tmp/qp.npz'\"",
    notes=(
        "reads the gin files `t5tpu train` reads; then `t5tpu train` and `t5tpu eval` with the "
        "same flags read the file instead of the task, importing neither seqio nor TensorFlow",
    ),
    compilation_cache=False,
)

PLAN = GinCommand(
    name="plan",
    summary="per-device memory of a training run and whether it fits, before paying for a slice",
    runner="t5tpu.runners.plan:plan",
    run_file="configs/runs/finetune.gin",
    defaults_files=("configs/runs/plan.gin",),
    macros=(_LENGTHS, _BATCH_SIZE, _MICROBATCHES, _PACKING),
    example="t5tpu plan --gin_file=configs/experiments/qp_is_duplicate_base_v2-8.gin",
    notes=(
        "reads the gin files `t5tpu train` reads (model, topology, run settings); plan.* "
        "bindings (plan.batch_size, ...) override the training run's",
        "a model gin alone (configs/models/mt5/small.gin) is planned on the CPU topology with "
        "BATCH_SIZE 128 and lengths 512/128 (configs/runs/plan.gin)",
        "--gin.plan.compile=True also compiles the train step with TPU's compiler (no TPU "
        "needed) and judges the fit by XLA's own memory figures",
    ),
    # Its compiles are measured, never run: an executable for compile-only TPU devices cannot be
    # loaded back from the cache, and a pod slice's is large.
    compilation_cache=False,
    tensorflow=False,
)

GIN_COMMANDS = {c.name: c for c in (TRAIN, EVAL, INFER, PREPARE_DATA, PLAN)}
TOOLS = {
    c.name: c
    for c in (
        ToolCommand(module=prepare_quora, tensorflow=True, compilation_cache=False),
        ToolCommand(module=convert, tensorflow=False, compilation_cache=True),
        # TensorFlow only for its pipeline workload (seqio's), imported there when it comes: the
        # model workloads run on a machine without it (scripts/accelerator_check.sh).
        ToolCommand(module=bench, tensorflow=False, compilation_cache=True, trains=True),
        ToolCommand(module=vertex, tensorflow=False, compilation_cache=False),
        # Its inputs and the tasks' prompts are shaped in Python: no TensorFlow.
        ToolCommand(module=serve, tensorflow=False, compilation_cache=True),
        ToolCommand(module=vertex_deploy, tensorflow=False, compilation_cache=False),
    )
}
USAGE = (
    f"usage: t5tpu {{{','.join(GIN_COMMANDS)}}} --gin_file=FILE [--gin.NAME=VALUE ...] | "
    f"t5tpu {{{','.join(TOOLS)}}} ...; t5tpu COMMAND --help"
)


def find(name: str) -> GinCommand | ToolCommand | None:
    return GIN_COMMANDS.get(name) or TOOLS.get(name)


def unknown_command(words: list[str]) -> str:
    given = " ".join(words) or "nothing"
    return f"expected one subcommand of {', '.join([*GIN_COMMANDS, *TOOLS])}, got {given}. {USAGE}"
