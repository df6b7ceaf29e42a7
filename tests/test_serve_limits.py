"""`t5tpu serve`'s limits against clients that are slow, idle, oversized or shut out: a real
uvicorn server on 127.0.0.1 with test_serve's stand-in engine (no jax in the server, quick),
timeouts set small; in a subprocess where signals are the point.

Idle sockets and slowloris senders past --max_connections cannot lock out /health or
/v1/predict; a slow head or body is a 408; a large head a 431 while it is still unfinished;
malformed HTTP, a wrong key, a non-JSON Content-Type and a lone surrogate are JSON errors;
shutdown past --shutdown_timeout answers 503 JSON with no traceback, and a second signal exits
at once. Bounded: a few hundred sockets, every wait a few seconds.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import http.client
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from cli_runs import ROOT, t5tpu
from test_serve import StandInEngine, health, predict, request

from t5tpu.cli import serve as serve_cli
from t5tpu.errors import UserError
from t5tpu.serve import app, batcher, server
from t5tpu.serve.connections import ConnectionLimits

LIMITS = ConnectionLimits(
    header_timeout_s=1.0,
    body_timeout_s=1.0,
    keep_alive_timeout_s=1.0,
    max_header_bytes=4096,
    max_headers=20,
)
MAX_CONNECTIONS = 16
KEY = "s3cret-key"
# Generous for a loaded 2-core machine: the done-when's 1 s is measured by hand.
ANSWER_WITHIN_S = 3.0


@contextlib.contextmanager
def running_server(api_key=None, limits=LIMITS):
    """(port, engine, running) of a stand-in server in this process, stopped after."""
    fake = StandInEngine()
    running = server.build(
        options=server.ServerOptions(
            max_connections=MAX_CONNECTIONS,
            shutdown_timeout_s=5,
            warm_up=False,
            log_requests=False,
            limits=limits,
            api_key=api_key,
        ),
        http=app.HttpOptions(max_instances=8, max_body_bytes=4096, truncation="warn", max_queue=8),
        batching=batcher.BatchLimits(max_batch_size=4, max_wait_s=0.0, max_queue=8),
        load=lambda: fake,
    )
    sock = server.bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    thread = threading.Thread(target=running.server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while health(port) != 200:
            assert time.monotonic() < deadline, "the stand-in server did not start"
            time.sleep(0.05)
        yield port, fake, running
    finally:
        running.server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def limited():
    with running_server() as started:
        yield started


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def answer(sock: socket.socket) -> tuple[int, dict, float]:
    """(status, JSON body, seconds waited) of the one answer the server sends, then closes."""
    start = time.monotonic()
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    assert b"content-type: application/json" in head.lower(), head
    return status, json.loads(body), time.monotonic() - start


def timed(call, *args):
    start = time.monotonic()
    result = call(*args)
    return result, time.monotonic() - start


def test_idle_and_slow_clients_past_the_budget_lock_out_neither_health_nor_predict():
    """Idle sockets, slowloris heads and slow bodies, many times --max_connections, timeouts
    long: the longest-waiting are closed to make room, and /health and /v1/predict answer."""
    patient = dataclasses.replace(LIMITS, header_timeout_s=60, body_timeout_s=60)
    with running_server(limits=patient) as (port, _, _):
        _lock_out(port)


def _lock_out(port: int) -> None:
    held = []
    try:
        for i in range(240):
            sock = connect(port)
            if i % 3 == 1:  # slowloris: a head begun, never ended
                sock.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            elif i % 3 == 2:  # a slow body: 1000 bytes promised, 10 sent
                sock.sendall(
                    b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                    b"\r\nContent-Length: 1000\r\n\r\n" + b'{"instance'
                )
            held.append(sock)
        for _ in range(3):
            status, seconds = timed(health, port)
            assert status == 200 and seconds < ANSWER_WITHIN_S, (status, seconds)
            answered, seconds = timed(predict, port, ["hello"])
            assert answered["predictions"] == ["HELLO t=0.0"] and seconds < ANSWER_WITHIN_S
            time.sleep(0.3)
        # All but the newest were closed, with no answer: their reads end at once.
        for sock in held[: len(held) - MAX_CONNECTIONS]:
            sock.settimeout(ANSWER_WITHIN_S)
            assert sock.recv(1) == b""
        for sock in held[len(held) - MAX_CONNECTIONS // 2 :]:  # the newest still wait
            sock.settimeout(0.05)
            with pytest.raises(TimeoutError):
                sock.recv(1)
    finally:
        for sock in held:
            sock.close()


def test_a_slow_head_or_body_is_a_408_and_an_idle_connection_is_closed(limited):
    port, _, _ = limited
    with connect(port) as slow_head, connect(port) as slow_body, connect(port) as idle:
        slow_head.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        slow_body.sendall(
            b"POST /v1/predict HTTP/1.1\r\nContent-Length: 100\r\n\r\n" + b'{"instances": ['
        )
        for sock, part in ((slow_head, "headers"), (slow_body, "body")):
            status, content, seconds = answer(sock)
            assert status == 408 and f"request's {part} took over 1 s" in content["error"]
            assert seconds < 1 + ANSWER_WITHIN_S
        start = time.monotonic()
        assert idle.recv(1) == b""  # closed, with no answer to a request never sent
        assert time.monotonic() - start < 1 + ANSWER_WITHIN_S
    with connect(port) as kept_alive:  # an answer, then idle: closed after the keep-alive time
        kept_alive.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in kept_alive.recv(65536)
        start = time.monotonic()
        assert kept_alive.recv(1) == b""
        assert 0.5 < time.monotonic() - start < 1 + ANSWER_WITHIN_S


def test_a_large_head_is_a_431_before_it_ends_and_too_many_headers_too(limited):
    port, _, _ = limited
    with connect(port) as one_large:
        one_large.sendall(b"GET /health HTTP/1.1\r\nX-Large: " + b"a" * 1_000_000 + b"\r\n\r\n")
        status, content, _ = answer(one_large)
        assert status == 431 and "over 4096 bytes" in content["error"]
    with connect(port) as unfinished:  # a megabyte of a header that never ends
        unfinished.sendall(b"GET /health HTTP/1.1\r\nX-Held: ")
        with contextlib.suppress(OSError):  # the server may close while this still sends
            for _ in range(16):
                unfinished.sendall(b"h" * 65536)
        status, content, _ = answer(unfinished)
        assert status == 431 and "over 4096 bytes" in content["error"]
    with connect(port) as many:
        many.sendall(b"GET /health HTTP/1.1\r\n" + b"X-A: 1\r\n" * 30 + b"\r\n")
        status, content, _ = answer(many)
        assert status == 431 and "over 20 headers" in content["error"]
    assert health(port) == 200


def test_malformed_http_is_a_400_in_json(limited):
    port, _, _ = limited
    with connect(port) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, content, _ = answer(sock)
        assert status == 400 and "not an HTTP/1.1 request" in content["error"]


@pytest.mark.parametrize(
    "path, instance",
    [
        ("/v1/predict", "a \ud800 b"),
        ("/v1/predict", "\udc00"),
        ("/v1/score", {"input": "a", "target": "\ud83d"}),
        ("/v1/is_duplicate", {"question1": "\udfff", "question2": "b"}),
    ],
)
def test_a_lone_surrogate_is_a_400_in_one_line_and_a_pair_is_served(limited, capfd, path, instance):
    port, _, _ = limited
    capfd.readouterr()
    body = json.dumps({"instances": [instance]}).encode()  # ensure_ascii: \ud800 escapes
    status, _, content = request(port, "POST", path, body)
    assert status == 400 and "lone surrogate" in content["error"], content
    assert "Traceback" not in "".join(capfd.readouterr())
    # The pair U+1F600 and an escaped backslash before "ud800" are text.
    paired = json.dumps({"instances": ["smile \U0001f600 \\ud800"]}).encode()
    status, _, content = request(port, "POST", "/v1/predict", paired)
    assert status == 200 and content["predictions"] == ["SMILE \U0001f600 \\UD800 t=0.0"]


def test_a_body_that_is_not_json_is_a_415_and_json_with_a_charset_is_served(limited):
    port, _, _ = limited

    def post(content_type):
        with connect(port) as sock:
            body = b'{"instances": ["hi"]}'
            header = b"" if content_type is None else b"Content-Type: " + content_type + b"\r\n"
            sock.sendall(
                b"POST /v1/predict HTTP/1.1\r\nConnection: close\r\n"
                + header
                + b"Content-Length: %d\r\n\r\n" % len(body)
                + body
            )
            return answer(sock)[:2]

    status, content = post(b"application/x-www-form-urlencoded")
    assert status == 415 and "Content-Type: application/json" in content["error"]
    for accepted in (b"application/json; charset=utf-8", b"application/vnd.api+json", None):
        assert post(accepted) == (200, {"predictions": ["HI t=0.0"]}), accepted


def test_an_api_key_is_asked_of_every_route_but_health():
    with running_server(api_key=KEY) as (port, _, _):
        assert health(port) == 200
        status, _, content = request(port, "GET", "/metrics")
        assert status == 401 and "API key" in content["error"]
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            status, answered, content = _post(port, headers)
            assert status == 401 and "Authorization: Bearer" in content["error"]
            assert answered["www-authenticate"] == "Bearer"
        status, _, content = _post(port, {"Authorization": f"Bearer {KEY}"})
        assert status == 200 and content == {"predictions": ["HI t=0.0"]}


def _post(port: int, headers: dict):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request(
            "POST",
            "/v1/predict",
            body=b'{"instances": ["hi"]}',
            headers={"Content-Type": "application/json", **headers},
        )
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read())
    finally:
        connection.close()


# --- shutdown, in a subprocess: signals go to its main thread ----------------------------------

# The stand-in server of test_serve, its model call held until the end: every request stays in
# flight until the shutdown's drain time is spent.
SHUTDOWN_SCRIPT = """
import sys
from test_serve import StandInEngine
from t5tpu.cli import serve as serve_cli
from t5tpu.errors import UserError
from t5tpu.serve import app, batcher, server

fake = StandInEngine()
fake.gate.clear()
sock = server.bind("127.0.0.1", 0)
sys.exit(server.serve(
    sock=sock,
    options=server.ServerOptions(
        max_connections=16, shutdown_timeout_s=float(sys.argv[1]), warm_up=False,
        log_requests=False,
    ),
    http=app.HttpOptions(max_instances=8, max_body_bytes=4096, truncation="warn", max_queue=8),
    batching=batcher.BatchLimits(max_batch_size=4, max_wait_s=0.0, max_queue=8),
    load=lambda: fake,
))
"""


def _held_requests(shutdown_timeout: float, signals: int, log):
    """Starts the script, four requests held in flight, then `signals` SIGTERMs half a second
    apart: (the requests' answers, the exit code, seconds from the first signal to the exit)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    command = [sys.executable, "-c", SHUTDOWN_SCRIPT, str(shutdown_timeout)]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        port = _port_of(log.name, process)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            held = [pool.submit(request, port, "POST", "/v1/predict", {"instances": ["x"]})]
            held += [pool.submit(request, port, "POST", "/v1/score", _SCORE) for _ in range(3)]
            time.sleep(1.0)  # all four in flight, the first in the held model call
            start = time.monotonic()
            for _ in range(signals):
                process.send_signal(signal.SIGTERM)
                time.sleep(0.5)
            answers = [future.result() for future in held]
            code = process.wait(timeout=30)
        return answers, code, time.monotonic() - start
    finally:
        if process.poll() is None:
            process.kill()


_SCORE = {"instances": [{"input": "a", "target": "b"}]}


def _port_of(log: str, process) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        with open(log) as f:
            for line in f:
                if "listening on http://127.0.0.1:" in line:
                    port = int(line.split("127.0.0.1:")[1].split(";")[0])
                    if health(port) == 200:
                        return port
        time.sleep(0.1)
    raise AssertionError(f"the shutdown script did not start:\n{pathlib.Path(log).read_text()}")


@pytest.mark.parametrize(
    "shutdown_timeout, signals, exits_within_s",
    [(1.0, 1, 1.0 + ANSWER_WITHIN_S + 1), (60.0, 2, 0.5 + ANSWER_WITHIN_S)],
    ids=["past the drain timeout", "a second signal"],
)
def test_shutdown_answers_the_requests_in_flight_503_in_json_with_no_traceback(
    tmp_path, shutdown_timeout, signals, exits_within_s
):
    with open(tmp_path / "log", "w") as log:
        answers, code, seconds = _held_requests(shutdown_timeout, signals, log)
    output = (tmp_path / "log").read_text()
    for status, _, content in answers:
        assert status == 503 and "shutting down" in content["error"], content
    assert code == 0 and seconds < exits_within_s, (code, seconds, output)
    assert "Traceback" not in output and "Internal Server Error" not in output, output


# --- the command's flags -------------------------------------------------------------------------


def test_listening_beyond_loopback_without_a_key_is_a_warning(tmp_path):
    """The warning comes as the port is bound, before the model (here: none) is loaded."""
    env = {k: v for k, v in os.environ.items() if k not in ("AIP_HTTP_PORT", "T5TPU_API_KEY")}
    missing = f"--model={tmp_path / 'nowhere'}"
    run = t5tpu("serve", "--host=0.0.0.0", "--port=0", missing, env=env, timeout=120)
    assert "warning: listening on 0.0.0.0 with no API key" in run.stdout, run.stdout
    run = t5tpu("serve", "--host=0.0.0.0", "--port=0", missing, env={**env, "T5TPU_API_KEY": KEY})
    assert run.returncode == 2 and "warning" not in run.stdout, run.stdout


def test_the_key_comes_from_its_file_else_the_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(f"{KEY}\n")
    from_file = serve_cli.parse_args([f"--api_key_file={key_file}"], {"T5TPU_API_KEY": "other"})
    assert from_file.api_key == KEY
    assert serve_cli.parse_args([], {"T5TPU_API_KEY": KEY}).api_key == KEY
    assert serve_cli.parse_args([], {}).api_key is None
    key_file.write_text("\n")
    with pytest.raises(UserError, match="must hold a key"):
        serve_cli.parse_args([f"--api_key_file={key_file}"], {})
