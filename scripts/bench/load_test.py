"""Load test of `t5tpu serve` on this machine: concurrent clients, each sending its requests one
after another over one keep-alive connection; errors, requests/s and latency percentiles, every
answer checked against the one the server gave the same input alone.

    python scripts/bench/load_test.py --gin_file=configs/experiments/qp_is_duplicate_tiny_cpu.gin \\
        --gin.MODEL_DIR="'/tmp/qp'" --clients=64 --requests=20 --compare_unbatched

starts `t5tpu serve` with the gin flags (and any --serve_flag) on a free port of 127.0.0.1,
waits for /health, runs the load, and stops the server with SIGTERM; --compare_unbatched does
it again with --max_batch_size=1 (one request at a time) for the gain of dynamic batching.
--url=http://127.0.0.1:PORT loads a server that is already running instead. Only loopback
addresses are accepted, every client's requests are bounded by --requests, and the whole run by
--time_limit seconds. One JSON line per run on stdout; docs/SERVING.md records results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--url", help="a running server (loopback only); default: start one")
    p.add_argument("--gin_file", action="append", default=[])
    p.add_argument("--serve_flag", action="append", default=[], help="passed to t5tpu serve")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=20, help="per client")
    p.add_argument("--instances", type=int, default=1, help="per request")
    p.add_argument("--inputs", default=os.path.join(ROOT, "examples", "questions.txt"))
    p.add_argument("--parameters", default="{}", help="the requests' parameters, as JSON")
    p.add_argument("--time_limit", type=float, default=600, help="seconds for the whole run")
    p.add_argument("--compare_unbatched", action="store_true")
    p.add_argument("--label", default="", help="recorded with the results")
    args, rest = p.parse_known_args(argv)
    args.gin_bindings = [a for a in rest if a.startswith("--gin.")]
    if len(args.gin_bindings) != len(rest):
        p.error(f"unknown arguments {[a for a in rest if not a.startswith('--gin.')]}")
    if min(args.clients, args.requests, args.instances) < 1:
        p.error("--clients, --requests and --instances must be >= 1")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def start_server(args, extra_flags: list[str], deadline: float) -> tuple[subprocess.Popen, str]:
    """`t5tpu serve` on a free loopback port, once its /health answers 200."""
    port = free_port()
    argv = [sys.executable, "-m", "t5tpu.cli.main", "serve", f"--port={port}"]
    argv += [f"--gin_file={f}" for f in args.gin_file] + args.gin_bindings
    argv += args.serve_flag + extra_flags
    server = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() < deadline and server.poll() is None:
        if _get(f"{url}/health") == 200:
            return server, url
        time.sleep(0.5)
    server.kill()
    raise SystemExit(f"the server did not become healthy (exit code {server.poll()})")


def stop_server(server: subprocess.Popen) -> int:
    server.send_signal(signal.SIGTERM)
    try:
        return server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        return server.wait()


class Connection:
    """One keep-alive HTTP/1.1 connection, a request at a time."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        await self.writer.drain()
        status_line = await self.reader.readline()
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        payload = await self.reader.readexactly(int(headers.get("content-length", 0)))
        if headers.get("connection", "").lower() == "close":
            self.close()
        return int(status_line.split()[1]), payload

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def _bodies(args, texts: list[str]) -> list[bytes]:
    """Request i's body: `instances` consecutive inputs, starting at i (cycling)."""
    parameters = json.loads(args.parameters)
    count = args.clients * args.requests
    return [
        json.dumps(
            {
                "instances": [texts[(i + j) % len(texts)] for j in range(args.instances)],
                "parameters": parameters,
            }
        ).encode()
        for i in range(count)
    ]


async def _client(host, port, bodies, expected, results, deadline) -> None:
    connection = Connection(host, port)
    try:
        for body in bodies:
            if time.monotonic() > deadline:
                results.append(("timeout", 0.0))
                continue
            start = time.perf_counter()
            try:
                status, payload = await asyncio.wait_for(
                    connection.post("/v1/predict", body), deadline - time.monotonic()
                )
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
                connection.close()
                results.append((type(e).__name__, time.perf_counter() - start))
                continue
            seconds = time.perf_counter() - start
            if status != 200:
                results.append((f"HTTP {status}", seconds))
            elif json.loads(payload)["predictions"] != expected[body]:
                results.append(("wrong answer", seconds))
            else:
                results.append(("ok", seconds))
    finally:
        connection.close()


async def _expected(host, port, bodies) -> dict[bytes, list]:
    """Each distinct body's answer, asked alone, one at a time."""
    connection = Connection(host, port)
    answers = {}
    try:
        for body in dict.fromkeys(bodies):
            status, payload = await connection.post("/v1/predict", body)
            if status != 200:
                raise SystemExit(f"a lone request failed: HTTP {status} {payload[:200]!r}")
            answers[body] = json.loads(payload)["predictions"]
    finally:
        connection.close()
    return answers


async def load(args, url: str, deadline: float) -> dict:
    parsed = urllib.parse.urlparse(url)
    host, port = parsed.hostname, parsed.port
    with open(args.inputs, encoding="utf-8") as f:
        texts = [line.strip() for line in f if line.strip()]
    bodies = _bodies(args, texts)
    expected = await _expected(host, port, bodies)
    results: list[tuple[str, float]] = []
    start = time.perf_counter()
    await asyncio.gather(
        *(
            _client(host, port, bodies[c :: args.clients], expected, results, deadline)
            for c in range(args.clients)
        )
    )
    seconds = time.perf_counter() - start
    return _summary(args, results, seconds)


def _summary(args, results: list[tuple[str, float]], seconds: float) -> dict:
    latencies = sorted(latency for outcome, latency in results if outcome == "ok")
    errors: dict[str, int] = {}
    for outcome, _ in results:
        if outcome != "ok":
            errors[outcome] = errors.get(outcome, 0) + 1

    def percentile(q: float) -> float | None:
        if not latencies:
            return None
        return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000, 1)

    return {
        "label": args.label,
        "clients": args.clients,
        "requests": len(results),
        "instances_per_request": args.instances,
        "ok": len(latencies),
        "errors": errors,
        "seconds": round(seconds, 2),
        "requests_per_s": round(len(latencies) / seconds, 1),
        "p50_ms": percentile(0.50),
        "p99_ms": percentile(0.99),
        "mean_ms": round(statistics.fmean(latencies) * 1000, 1) if latencies else None,
        "load_average_1m": os.getloadavg()[0],
    }


def run(args, extra_flags: list[str], label: str, deadline: float) -> dict:
    if args.url:
        host = urllib.parse.urlparse(args.url).hostname
        if host not in LOOPBACK:
            raise SystemExit(f"--url={args.url}: this load test only targets 127.0.0.1")
        summary = asyncio.run(load(args, args.url, deadline))
    else:
        server, url = start_server(args, extra_flags, deadline)
        try:
            summary = asyncio.run(load(args, url, deadline))
        finally:
            summary_exit = stop_server(server)
        summary["server_exit_code"] = summary_exit
    summary["server_flags"] = args.serve_flag + extra_flags
    summary["label"] = label
    print(json.dumps(summary), flush=True)
    return summary


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.time_limit
    batched = run(args, [], args.label or "dynamic batching", deadline)
    if args.compare_unbatched and not args.url:
        one = run(args, ["--max_batch_size=1"], "one request at a time", deadline)
        gain = batched["requests_per_s"] / max(one["requests_per_s"], 1e-9)
        print(json.dumps({"label": "gain", "requests_per_s_ratio": round(gain, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
