"""Runs the t5tpu command line as a machine without TensorFlow would: tensorflow, seqio, clu
(whose writers are TensorFlow's) and tensorflow_datasets are absent (None in sys.modules: an
import fails as for a package not installed, importlib.util.find_spec says None), and at exit a
JSON line goes to REPORT naming those that were imported all the same (none, or a test fails).

    python scripts/without_tensorflow.py REPORT train --gin_file=... --gin.PREPARED_DATA=...

The CPU twin of scripts/accelerator_check.sh (tests/test_prepared_data.py) runs the prepared
data's train and eval so, on a machine that has TensorFlow.
"""

import atexit
import json
import runpy
import sys

ABSENT = ("tensorflow", "seqio", "clu", "tensorflow_datasets")


def _report(path: str) -> None:
    imported = sorted(
        name
        for name, module in sys.modules.items()
        if module is not None and name.split(".")[0] in ABSENT
    )
    with open(path, "w") as f:
        f.write(json.dumps({"imported": imported}) + "\n")


def main() -> None:
    report, *args = sys.argv[1:]
    for name in ABSENT:
        sys.modules[name] = None
    # t5tpu ends with os._exit after running the atexit handlers (cli/main.py's finish).
    atexit.register(_report, report)
    sys.argv = ["t5tpu", *args]
    runpy.run_module("t5tpu.cli.main", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
