"""t5tpu from Python, as a notebook would use it: fine-tune the tiny CPU demo model on the
bundled Quora sample, load it, and ask it questions.

    python examples/python_api.py --model_dir=/tmp/t5tpu_api_demo --steps=200

The same calls work on a TPU VM with a real experiment gin and a gs:// MODEL_DIR.
"""

import argparse

from t5tpu.tasks import quora

import t5tpu

EXPERIMENT = "configs/experiments/qp_is_duplicate_tiny_cpu.gin"
PAIRS = [
    ("How do I learn Python quickly?", "What is the fastest way to learn Python?"),
    ("What is the capital of France?", "How do I bake bread at home?"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", default="/tmp/t5tpu_api_demo")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    # A rerun continues from the newest checkpoint (and does nothing once at --steps).
    model_dir = t5tpu.finetune(
        EXPERIMENT, model_dir=args.model_dir, TRAIN_STEPS=args.steps, EVAL_PERIOD=0
    )
    model = t5tpu.load(model_dir)
    print(model)
    for question1, question2 in PAIRS:
        verdict = quora.is_duplicate(model, question1, question2)
        print(f"is_duplicate({question1!r}, {question2!r}) = {verdict}")
    print(model.predict(["is duplicate: how do i sleep better? <SEP> how can i sleep well?"]))


if __name__ == "__main__":
    main()
