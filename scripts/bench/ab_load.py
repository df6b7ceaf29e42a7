"""`t5tpu serve` as a service answering one-line questions: its start-up time, `ab`'s load
numbers and its resident memory after the load (docs/SERVING.md and docs/PERFORMANCE.md).

    T5TPU_COMPILATION_CACHE=off .venv/bin/python scripts/bench/ab_load.py \\
        --gin_file=configs/experiments/qp_is_duplicate_tiny_cpu.gin --model_dir=/tmp/t5tpu_demo
    # one LoRA adapter served beside the base:  --adapter=qp=/tmp/qp_lora
    # streamed answers (server-sent events):      --parameters='{"stream": true}'

Starts the server on a free port of 127.0.0.1, times /health until 200, sends one request
alone, then `ab -n REQUESTS -c CLIENTS` (apt's apache2-utils) with a one-question body, reads
the server's resident memory, programs and programs lowered from /proc and /metrics, stops it
with SIGTERM, and prints one JSON object. Bounded: ab's own time limit, and every wait.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BODY = {"instances": ["is duplicate: how do i learn python? <SEP> how can i learn python fast?"]}


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gin_file", required=True)
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--adapter", action="append", default=[])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--time_limit", type=int, default=300)
    parser.add_argument(
        "--parameters", type=json.loads, default={}, help="the body's, e.g. '{\"stream\": true}'"
    )
    return parser.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(port: int, path: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, ""
    except OSError:
        return 0, ""


def _metric(text: str, name: str) -> float | None:
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return round(kb / 1024, 1)


def _ab(port: int, args, body_file: str) -> dict:
    # -t first: it sets -n to 50,000, and the -n after it sets it back.
    command = ["ab", "-q", "-t", str(args.time_limit), "-n", str(args.requests)]
    command += ["-c", str(args.clients), "-p", body_file, "-T", "application/json"]
    out = subprocess.run(
        [*command, f"http://127.0.0.1:{port}/v1/predict"],
        capture_output=True,
        text=True,
        timeout=args.time_limit + 60,
    ).stdout
    number = lambda pattern: float(re.search(pattern, out).group(1))  # noqa: E731
    return {
        "completed": int(number(r"Complete requests:\s+(\d+)")),
        "failed": int(number(r"Failed requests:\s+(\d+)")),
        "non_2xx": int(number(r"Non-2xx responses:\s+(\d+)")) if "Non-2xx" in out else 0,
        "requests_per_s": number(r"Requests per second:\s+([\d.]+)"),
        "p50_ms": number(r"\s50%\s+(\d+)"),
        "p99_ms": number(r"\s99%\s+(\d+)"),
    }


def main(argv=None) -> None:
    args = _parse(argv)
    port = _free_port()
    command = [sys.executable, "-m", "t5tpu.cli.main", "serve", f"--port={port}"]
    command += [f"--gin_file={args.gin_file}", f"--gin.MODEL_DIR='{args.model_dir}'"]
    command += [f"--adapter={a}" for a in args.adapter]
    log = os.path.join(tempfile.mkdtemp(), "serve.log")
    start = time.perf_counter()
    with open(log, "w") as out:
        server = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        while _get(port, "/health")[0] != 200:
            if server.poll() is not None or time.perf_counter() - start > 600:
                raise SystemExit(f"the server did not get ready; its log: {log}")
            time.sleep(0.1)
        ready_s = round(time.perf_counter() - start, 1)
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as body:
            json.dump({**BODY, "parameters": args.parameters}, body)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/predict",
            data=json.dumps({**BODY, "parameters": args.parameters}).encode(),
            headers={"Content-Type": "application/json"},  # urllib's own default is a form's
        )
        urllib.request.urlopen(request, timeout=60).read()
        _, before = _get(port, "/metrics")
        load = _ab(port, args, body.name)
        _, after = _get(port, "/metrics")
        result = {
            "ready_s": ready_s,
            **load,
            "rss_mb_after": _rss_mb(server.pid),
            "programs": _metric(after, "t5tpu_serve_programs"),
            "lowered_during_load": _metric(after, "t5tpu_serve_programs_lowered")
            - _metric(before, "t5tpu_serve_programs_lowered"),
            "load_average": os.getloadavg()[0],
            "cache": os.environ.get("T5TPU_COMPILATION_CACHE", "default"),
        }
    finally:
        server.send_signal(signal.SIGTERM)
        result_code = server.wait(timeout=120)
    print(json.dumps({**result, "exit_code": result_code}), flush=True)


if __name__ == "__main__":
    main()
