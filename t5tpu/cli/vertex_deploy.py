"""`t5tpu vertex-deploy`: serve a trained model on a Vertex AI endpoint with `t5tpu serve` in the
t5tpu container. --dry_run prints the Model upload and Endpoint deployment as JSON, with no
network and no Google client; deploying needs `pip install 't5tpu[vertex]'`.
"""

from __future__ import annotations

import argparse
import json

from t5tpu.cli.gin_flags import rewrite_gin_shorthand
from t5tpu.cli.tool_parser import ToolParser
from t5tpu.cli.vertex import check_gin_file
from t5tpu.cloud import vertex_spec
from t5tpu.errors import UserError

NAME = "vertex-deploy"
SUMMARY = "serve a model on a Vertex AI endpoint (--dry_run prints the upload and deployment)"
EXAMPLE = (
    "t5tpu vertex-deploy --model_dir=gs://my-bucket/t5tpu/qp "
    "--gin_file=configs/experiments/qp_is_duplicate_tiny_cpu.gin "
    "--image=us-docker.pkg.dev/my-project/t5tpu/t5tpu:cpu --project=my-project --dry_run"
)
_DESCRIPTION = """\
Upload a model to Vertex AI with the t5tpu image as its serving container and deploy it to a \
new endpoint. Vertex AI copies --model_dir (a MODEL_DIR, best one holding only the checkpoint_N \
to serve, or a Hugging Face directory from `t5tpu convert --to=hf`) into the container, which \
runs `t5tpu serve` on port 8080: predictions at /v1/predict, health at /health. The model \
answers as its run trained it (the run record in its checkpoint: lengths, input shaping, \
decoding); gin files that override those must be in the image (the shipped configs/...) or on \
gs://.

The machine: --machine_type (CPU, default n1-standard-4), --gpu=NAME:COUNT or --tpu=v5e-N. \
--gin.NAME=VALUE and --gin_bindings='NAME = VALUE' pass on to the server, and so does each \
--serve_flag (e.g. --serve_flag=--max_batch_size=64)."""


def parser() -> ToolParser:
    p = ToolParser(prog=f"t5tpu {NAME}", description=_DESCRIPTION, example=EXAMPLE)
    p.add_argument("--model_dir", required=True, metavar="gs://PATH", help="the model to serve")
    p.add_argument("--image", required=True, help="the pushed t5tpu image URI")
    p.add_argument("--gin_file", action="append", default=[], metavar="FILE")
    p.add_argument("--gin_bindings", action="append", default=[], metavar="'NAME = VALUE'")
    p.add_argument("--serve_flag", action="append", default=[], metavar="--FLAG=VALUE")
    machine = p.add_mutually_exclusive_group()
    machine.add_argument("--machine_type", help=vertex_spec.DEFAULT_PREDICTION_MACHINE)
    machine.add_argument("--gpu", metavar="NAME:COUNT", help="e.g. l4:1, a100:1")
    machine.add_argument("--tpu", choices=sorted(vertex_spec.PREDICTION_TPUS))
    p.add_argument("--min_replicas", type=int, default=1)
    p.add_argument("--max_replicas", type=int, default=1)
    p.add_argument("--display_name", default="t5tpu", help="the model's and endpoint's name")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--project", help="Google Cloud project (default: gcloud's)")
    p.add_argument("--region", default="us-central1")
    p.add_argument("--dry_run", action="store_true", help="print the requests and stop")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    return parser().parse_args(rewrite_gin_shorthand(argv))


def request(args: argparse.Namespace) -> vertex_spec.DeployRequest:
    for path in args.gin_file:
        check_gin_file(path)
    return vertex_spec.DeployRequest(
        model_dir=args.model_dir,
        image=args.image,
        display_name=args.display_name,
        gin_files=tuple(args.gin_file),
        bindings=tuple(b.replace(" = ", "=", 1) for b in args.gin_bindings),
        serve_flags=tuple(args.serve_flag),
        machine_type=args.machine_type,
        tpu=args.tpu,
        gpu=args.gpu,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        env=tuple(args.env),
    )


def _deploy(spec: dict, args: argparse.Namespace) -> str:
    try:
        from google.cloud import aiplatform
    except ImportError:
        raise UserError(
            "deploying needs google-cloud-aiplatform: pip install 't5tpu[vertex]' (or use "
            "--dry_run and `gcloud ai models upload` / `gcloud ai endpoints deploy-model`)"
        ) from None
    aiplatform.init(project=args.project, location=args.region)
    container = spec["model_upload"]["model"]["container_spec"]
    env = {entry["name"]: entry["value"] for entry in container.get("env", [])}
    model = aiplatform.Model.upload(
        display_name=args.display_name,
        artifact_uri=args.model_dir,
        serving_container_image_uri=container["image_uri"],
        serving_container_args=container["args"],
        serving_container_environment_variables=env,
        serving_container_ports=[port["container_port"] for port in container["ports"]],
        serving_container_predict_route=container["predict_route"],
        serving_container_health_route=container["health_route"],
    )
    endpoint = aiplatform.Endpoint.create(display_name=args.display_name)
    resources = spec["deploy"]["deployed_model"]["dedicated_resources"]
    model.deploy(
        endpoint=endpoint,
        deployed_model_display_name=args.display_name,
        traffic_split=spec["deploy"]["traffic_split"],
        min_replica_count=resources["min_replica_count"],
        max_replica_count=resources["max_replica_count"],
        **resources["machine_spec"],
    )
    return endpoint.resource_name


def run(args: argparse.Namespace) -> int:
    spec = vertex_spec.deployment(request(args))
    if args.dry_run:
        print(json.dumps(spec, indent=2))
        return 0
    name = _deploy(spec, args)
    route = vertex_spec.PREDICT_ROUTE
    print(f"deployed {args.model_dir} to {name}; predictions at {route}", flush=True)
    return 0
