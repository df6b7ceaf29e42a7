"""No TensorFlow or absl C++ log line reaches stderr, whoever imports TensorFlow first (etils'
gs:// client did, loudly): a command that fails on an unreachable gs:// vocabulary says its one
line and nothing else, and the Python API loads, fails and decodes without a foreign line.
test_cli.py and test_api.py check the same of train, eval, infer and convert runs they make."""

import os
import subprocess
import sys

import pytest
from cli_runs import ROOT, TINY_EXPERIMENT, foreign_log_lines, t5tpu

VOCABULARY = "gs://t5-data/vocabs/cc_all.32000/sentencepiece.model"  # the T5 1.1 models' own
SETTING = "default_vocabulary.sentencepiece_model_file"


def _offline_env() -> dict:
    """gs:// unreachable, at once, with or without a network: TensorFlow's GCS client (libcurl)
    is sent through a proxy whose name never resolves (.invalid is reserved for that)."""
    return {
        **os.environ,
        **{name: "http://proxy.invalid:3128" for name in ("https_proxy", "HTTPS_PROXY")},
        **{name: "" for name in ("no_proxy", "NO_PROXY")},
    }


def test_foreign_log_lines_are_told_from_t5tpus_own():
    stderr = (
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
        "I0000 00:00:1795690182.597598   18098 port.cc:153] oneDNN custom operations are on.\n"
        "W0000 00:00:1795690184.779215   18098 google_auth_provider.cc:196] All attempts...\n"
        "E0000 00:00:1795690183.935869   18098 cuda_platform.cc:52] failed call to cuInit\n"
        "step 2/2  loss 7.6798  token_acc 0.000  lr 0.003  4.6 examples/s  ETA 0:00:00\n"
        "t5tpu: error: MODEL_DIR=/tmp/x: no checkpoint_N in it; train first\n"
    )
    assert foreign_log_lines(stderr) == stderr.splitlines()[:4]


def test_an_unreachable_vocabulary_is_one_line_and_nothing_else(tmp_path):
    run = t5tpu(
        "infer",
        f"--gin_file={TINY_EXPERIMENT}",
        f"--gin.{SETTING}='{VOCABULARY}'",
        "--gin.INFER_INPUT_FILE='examples/questions.txt'",
        model_dir=tmp_path / "model",
        env=_offline_env(),
        timeout=300,
    )
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2, run.stderr[-3000:]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"t5tpu: error: {SETTING}={VOCABULARY}: "), lines
    assert "cannot reach gs://t5-data" in lines[0] or "did not answer" in lines[0], lines


# The vocabulary refused first, so that TensorFlow's first import is the failing load's.
LOAD_AND_PREDICT = """
import sys
import t5tpu
from t5tpu.errors import UserError

model_dir, vocabulary_gin = sys.argv[1:]
try:
    t5tpu.load(model_dir, gin_files=[vocabulary_gin])
except UserError as e:
    print("refused:", str(e).splitlines()[0])
print("answer:", t5tpu.load(model_dir).predict(["is duplicate: a? <SEP> b?"])[0])
"""


@pytest.mark.slow  # needs the trained_tiny run
def test_the_python_api_fails_and_decodes_without_foreign_lines(trained_tiny, tmp_path):
    vocabulary_gin = tmp_path / "vocabulary.gin"
    vocabulary_gin.write_text(f"MODEL/{SETTING} = '{VOCABULARY}'\n")
    run = subprocess.run(
        [sys.executable, "-c", LOAD_AND_PREDICT, str(trained_tiny), str(vocabulary_gin)],
        cwd=ROOT,
        env=_offline_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"refused: {SETTING}={VOCABULARY}: " in run.stdout, run.stdout
    assert "answer: " in run.stdout, run.stdout
    assert not foreign_log_lines(run.stderr), run.stderr[-3000:]
