"""`t5tpu serve`: a model behind HTTP, requests that arrive together decoded together, as a
Vertex AI prediction container or on its own.

This module is the command: its flags, checked before anything is loaded. The server itself is
t5tpu/serve/, imported once the flags are good (it loads jax). docs/SERVING.md has the routes,
payloads and measurements.
"""

from __future__ import annotations

import argparse
import ipaddress
import os

from t5tpu import validators
from t5tpu.cli.gin_flags import rewrite_gin_shorthand
from t5tpu.cli.tool_parser import ToolParser
from t5tpu.errors import UserError

NAME = "serve"
SUMMARY = "answer HTTP requests with a model, batching requests that arrive together"
EXAMPLE = (
    "t5tpu serve --gin_file=configs/experiments/qp_is_duplicate_tiny_cpu.gin "
    "--gin.MODEL_DIR=\"'/tmp/qp'\" --port=8080"
)
# Vertex AI's prediction containers are told their port and routes, and where the model is.
PORT_VARIABLE = "AIP_HTTP_PORT"
ROUTE_VARIABLES = {"predict": "AIP_PREDICT_ROUTE", "health": "AIP_HEALTH_ROUTE"}
API_KEY_VARIABLE = "T5TPU_API_KEY"
DEFAULT_PORT = 8080
_DESCRIPTION = """\
Serve a model over HTTP: POST /v1/predict ({"instances": ["..."], "parameters": {"num_beams", \
"max_length", "temperature", "top_k", "top_p", "seed"}} -> {"predictions": ["..."]}), /v1/score, \
/v1/is_duplicate, /v1/similar_question and /v1/answer; GET /health (503 until the model is \
loaded and compiled, then 200) and /metrics (Prometheus). docs/SERVING.md has every payload.

The model: --model (a MODEL_DIR, checkpoint_N, Hugging Face or T5X directory), else MODEL_DIR \
bound in the gin files (at CHECKPOINT_STEP), else AIP_STORAGE_URI. It answers as its run \
trained it (the run record saved with each checkpoint): inputs shaped as the run's task shaped \
its training inputs ("exact_inputs": true takes them as they are), the run's lengths and \
decoding. The gin files, where they bind them, give what `t5tpu infer` takes from them instead: \
TASK_FEATURE_LENGTHS, NUM_BEAMS, TEMPERATURE, TOP_K and INFER_TRUNCATION; a request's \
parameters override the decoding settings, and its answers are those `t5tpu infer` writes for \
the same inputs and settings. Each --adapter \
NAME=MODEL_DIR (a LoRA run of the served model) is served beside it over the one base in memory: \
a request with "parameters": {"adapter": "NAME"} runs with it.

Requests that arrive within --max_wait_ms of each other with the same decoding settings are \
decoded in one batch of up to --max_batch_size rows, padded to a few compiled shapes; a row is \
answered when it ends and later requests take its place in the running batch. At most \
--max_queue rows wait; beyond that a request gets 503 with Retry-After. SIGTERM stops taking \
connections, finishes the requests in flight and exits 0; a second one cuts them short (503).

With --api_key_file (or $T5TPU_API_KEY) every route but /health asks for the header \
Authorization: Bearer KEY. Slow or idle clients are timed out and, past --max_connections, the \
one idle longest is closed, so /health answers whatever they hold.

As a Vertex AI container (the image's entrypoint serves when AIP_HTTP_PORT is set), the port \
is AIP_HTTP_PORT and AIP_PREDICT_ROUTE and AIP_HEALTH_ROUTE answer too."""


def parser() -> ToolParser:
    p = ToolParser(prog=f"t5tpu {NAME}", description=_DESCRIPTION, example=EXAMPLE)
    p.add_gin_flags(gin_file_help="gin file(s)")
    p.add_argument("--model", metavar="PATH", help="the model, when not MODEL_DIR")
    p.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=MODEL_DIR",
        help='a LoRA run over the model, chosen by a request\'s "adapter" parameter '
        "(repeatable; without --model, the model is the first adapter's base)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    p.add_argument("--port", type=int, help=f"default: ${PORT_VARIABLE}, else {DEFAULT_PORT}")
    p.add_argument("--max_input_length", type=int, help="default: TASK_FEATURE_LENGTHS's")
    p.add_argument("--max_target_length", type=int, help="default: TASK_FEATURE_LENGTHS's")
    p.add_argument(
        "--truncation", choices=("warn", "error"), help="long inputs; default: INFER_TRUNCATION"
    )
    p.add_argument("--max_batch_size", type=int, default=32, help="rows per model call")
    p.add_argument("--max_wait_ms", type=float, default=5.0, help="wait for batch mates")
    p.add_argument("--max_queue", type=int, default=512, help="rows waiting; then 503")
    p.add_argument("--max_instances", type=int, default=128, help="instances per request")
    p.add_argument("--max_body_bytes", type=int, default=1_572_864, help="then 413")
    p.add_argument(
        "--max_connections",
        type=int,
        default=256,
        help="open (then the longest idle is closed) and in flight (then 503)",
    )
    p.add_argument("--shutdown_timeout", type=float, default=30.0, help="seconds, after SIGTERM")
    _add_connection_limits(p)
    p.add_argument(
        "--api_key_file",
        metavar="PATH",
        help=f"a file holding the key every route but /health asks for (or ${API_KEY_VARIABLE})",
    )
    p.add_argument(
        "--no_warmup",
        action="store_true",
        help="report ready once loaded; compile each program on its first use",
    )
    p.add_argument("--log_requests", action="store_true", help="print a line per request")
    return p


def _add_connection_limits(p: ToolParser) -> None:
    """The flags of connections.py's limits, their defaults its own."""
    from t5tpu.serve.connections import ConnectionLimits  # uvicorn's parser, jax not

    limits = ConnectionLimits()
    for name, what in (
        ("header_timeout", "seconds for a request's head; then 408"),
        ("body_timeout", "seconds for its body, after the head; then 408"),
        ("keep_alive_timeout", "seconds idle between requests; then closed"),
    ):
        p.add_argument(f"--{name}", type=float, default=getattr(limits, f"{name}_s"), help=what)
    p.add_argument(
        "--max_header_bytes",
        type=int,
        default=limits.max_header_bytes,
        help="a request's head (URL, headers); then 431",
    )
    p.add_argument(
        "--max_headers", type=int, default=limits.max_headers, help="headers a request; then 431"
    )


def _check(args: argparse.Namespace) -> None:
    wholes = ("max_batch_size", "max_queue", "max_instances", "max_body_bytes")
    for name in (*wholes, "max_header_bytes", "max_headers"):
        validators.whole(low=1).check(f"--{name}", getattr(args, name))
    for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
        if not getattr(args, name) > 0:
            raise UserError(f"--{name}={getattr(args, name)} must be above 0 seconds")
    for name in ("max_connections", "max_input_length", "max_target_length"):
        validators.optional(validators.whole(low=1)).check(f"--{name}", getattr(args, name))
    if not 0 <= args.port <= 65535:
        raise UserError(f"port {args.port} must be from 0 to 65535 (0: any free port)")
    if not (0 <= args.max_wait_ms <= 1000 and args.shutdown_timeout >= 0):
        raise UserError("--max_wait_ms must be from 0 to 1000 and --shutdown_timeout >= 0")
    if args.max_instances > args.max_queue:
        raise UserError(
            f"--max_instances={args.max_instances} is more than --max_queue={args.max_queue} "
            "rows: such a request could never be queued"
        )
    for route in args.predict_routes + args.health_routes:
        if not route.startswith("/"):
            raise UserError(f"route {route!r} (from AIP_*_ROUTE) must start with /")


def parse_args(argv: list[str], environ: dict | None = None) -> argparse.Namespace:
    environ = os.environ if environ is None else environ
    args = parser().parse_args(rewrite_gin_shorthand(argv))
    if args.port is None:
        port = environ.get(PORT_VARIABLE, str(DEFAULT_PORT))
        if not port.isdigit():
            raise UserError(f"{PORT_VARIABLE}={port!r} must be a port number")
        args.port = int(port)
    routes = {kind: environ.get(variable) for kind, variable in ROUTE_VARIABLES.items()}
    args.predict_routes = sorted({"/v1/predict", routes["predict"] or "/v1/predict"})
    args.health_routes = sorted({"/health", routes["health"] or "/health"})
    _check(args)
    args.api_key = _api_key(args.api_key_file, environ)
    return args


def _api_key(path: str | None, environ) -> str | None:
    """The key in --api_key_file (its surrounding whitespace dropped), else $T5TPU_API_KEY."""
    if path is None:
        key = environ.get(API_KEY_VARIABLE)
        where = f"${API_KEY_VARIABLE}"
    else:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read --api_key_file={path}: {e}") from None
        where = f"--api_key_file={path}"
    if key is None:
        return None
    key = key.strip()
    if not key or not key.isascii() or not key.isprintable():
        raise UserError(f"{where} must hold a key: printable ASCII, with no whitespace around it")
    return key


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: where it points is not known here


def run(args: argparse.Namespace) -> int:
    import functools

    from t5tpu.serve import app, batcher, model_setup, server
    from t5tpu.serve.connections import ConnectionLimits

    # The port first: a port in use is one line before anything is read.
    sock = server.bind(args.host, args.port)
    # Vertex AI's endpoint authenticates its callers: a prediction container needs no key.
    if args.api_key is None and not _loopback(args.host) and PORT_VARIABLE not in os.environ:
        server.say(
            f"warning: listening on {args.host} with no API key: anyone who reaches port "
            f"{sock.getsockname()[1]} can use the model; set --api_key_file or ${API_KEY_VARIABLE}"
        )
    setup = model_setup.model_setup(
        gin_flags=model_setup.GinFlags(
            files=tuple(args.gin_file),
            bindings=tuple(args.gin_bindings),
            search_paths=tuple(path for path in args.gin_search_paths.split(",") if path),
        ),
        model=args.model,
        lengths=(args.max_input_length, args.max_target_length),
        truncation=args.truncation,
        environ=dict(os.environ),
        adapters=tuple(args.adapter),
        say=server.say,
    )
    return server.serve(
        sock=sock,
        options=server.ServerOptions(
            max_connections=args.max_connections,
            shutdown_timeout_s=args.shutdown_timeout,
            warm_up=not args.no_warmup,
            log_requests=args.log_requests,
            limits=ConnectionLimits(
                header_timeout_s=args.header_timeout,
                body_timeout_s=args.body_timeout,
                keep_alive_timeout_s=args.keep_alive_timeout,
                max_header_bytes=args.max_header_bytes,
                max_headers=args.max_headers,
            ),
            api_key=args.api_key,
        ),
        http=app.HttpOptions(
            max_instances=args.max_instances,
            max_body_bytes=args.max_body_bytes,
            truncation=setup.truncation,
            max_queue=args.max_queue,
            predict_routes=tuple(args.predict_routes),
            health_routes=tuple(args.health_routes),
        ),
        batching=batcher.BatchLimits(
            max_batch_size=args.max_batch_size,
            max_wait_s=args.max_wait_ms / 1000,
            max_queue=args.max_queue,
        ),
        load=functools.partial(
            model_setup.load_worker, setup, max_batch_size=args.max_batch_size, say=server.say
        ),
    )
