"""Shared by the tests that need 8 devices: XLA fixes the CPU device count when jax starts, so
those tests run their own file as a script in a subprocess with 8 fake CPU devices."""

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script_on_eight_devices(script: str, *args: str, env: dict | None = None) -> dict:
    """Runs `script` with 8 fake CPU devices (in `env`, by default this process's environment);
    returns the JSON of its last stdout line."""
    env = dict(
        env or os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
    )
    run = subprocess.run(
        [sys.executable, os.path.abspath(script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def padded_batch(rng, batch_size: int, input_length: int, target_length: int) -> dict:
    """Random token ids with padding at the ends of rows, as the feature converter makes them."""

    def tokens(length):
        ids = rng.integers(2, 1024, size=(batch_size, length)).astype(np.int32)
        lengths = rng.integers(length // 2, length + 1, size=batch_size)
        ids[np.arange(length)[None, :] >= lengths[:, None]] = 0
        return ids

    targets = tokens(target_length)
    decoder_inputs = np.concatenate([np.zeros((batch_size, 1), np.int32), targets[:, :-1]], 1)
    return {
        "encoder_input_tokens": tokens(input_length),
        "decoder_input_tokens": decoder_inputs,
        "decoder_target_tokens": targets,
        "decoder_loss_weights": (targets > 0).astype(np.float32),
    }
