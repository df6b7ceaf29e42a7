"""`t5tpu vertex-submit`: run `t5tpu train` (or eval, infer) as a Vertex AI custom job in the
t5tpu container (Dockerfile), on a TPU or GPU machine. --dry_run prints the job as JSON, with no
network and no Google client; submitting needs `pip install 't5tpu[vertex]'`.
"""

from __future__ import annotations

import argparse
import json
import os

from t5tpu import package_files
from t5tpu.cli.tool_parser import ToolParser
from t5tpu.cloud import vertex_spec
from t5tpu.errors import UserError
from t5tpu.storage import locations

NAME = "vertex-submit"
SUMMARY = "run train/eval/infer as a Vertex AI custom job (--dry_run prints its spec)"
EXAMPLE = (
    "t5tpu vertex-submit --gin_file=configs/experiments/squad_v1_base_v2-8.gin --tpu=v2-8 "
    "--project=my-project --region=us-central1 --image=us-docker.pkg.dev/my-project/t5tpu/"
    "t5tpu:tpu --staging_bucket=gs://my-bucket --gin.TRAIN_STEPS=1000 --dry_run"
)


def parser() -> ToolParser:
    parser = ToolParser(
        prog=f"t5tpu {NAME}",
        description="Submit a t5tpu command as a Vertex AI CustomJob running the t5tpu image "
        "(built from the repository's Dockerfile, with JAX_EXTRA=tpu for TPUs). MODEL_DIR is "
        "STAGING_BUCKET/t5tpu/DISPLAY_NAME unless --gin.MODEL_DIR sets it. Gin files must be "
        "in the image (the shipped configs/...) or on gs://.\n\n"
        "--gin.NAME=VALUE and --gin_bindings='NAME = VALUE' pass on to the command.",
        example=EXAMPLE,
    )
    parser.add_argument("--command", default="train", choices=vertex_spec.COMMANDS)
    parser.add_argument("--gin_file", action="append", required=True, metavar="FILE")
    parser.add_argument("--gin_bindings", action="append", default=[], metavar="'NAME = VALUE'")
    machine = parser.add_mutually_exclusive_group(required=True)
    machine.add_argument("--tpu", choices=sorted(vertex_spec.TPU_MACHINES))
    machine.add_argument("--gpu", metavar="NAME:COUNT", help="e.g. a100:1, a100:8, h100:8, l4:1")
    parser.add_argument("--image", required=True, help="the pushed t5tpu image URI")
    parser.add_argument("--staging_bucket", required=True, metavar="gs://BUCKET")
    parser.add_argument("--project", help="Google Cloud project (default: gcloud's)")
    parser.add_argument("--region", default="us-central1")
    parser.add_argument("--display_name", default="t5tpu", help="the job's name")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--dry_run", action="store_true", help="print the job spec and stop")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """argparse cannot declare `--gin.NAME=VALUE` flags; they are taken out first, as bindings."""
    gin_flags = [arg for arg in argv if arg.startswith("--gin.")]
    args = parser().parse_args([arg for arg in argv if not arg.startswith("--gin.")])
    args.gin_bindings += [arg[len("--gin.") :] for arg in gin_flags]
    return args


def check_gin_file(path: str) -> None:
    """The job reads gin files inside the container: shipped configs or gs:// ones."""
    if locations.is_remote(path):
        return
    if not os.path.isfile(os.path.join(package_files.config_search_path(), path)):
        raise UserError(
            f"--gin_file={path} is not a shipped config, so the container cannot read it: copy it "
            "to gs:// and pass that path, or build it into the image"
        )


def request(args: argparse.Namespace) -> vertex_spec.JobRequest:
    for path in args.gin_file:
        check_gin_file(path)
    return vertex_spec.JobRequest(
        command=args.command,
        gin_files=tuple(args.gin_file),
        bindings=tuple(b.replace(" = ", "=", 1) for b in args.gin_bindings),
        image=args.image,
        staging_bucket=args.staging_bucket,
        display_name=args.display_name,
        tpu=args.tpu,
        gpu=args.gpu,
        env=tuple(args.env),
    )


def _submit(job: dict, args: argparse.Namespace) -> str:
    try:
        from google.cloud import aiplatform
    except ImportError:
        raise UserError(
            "submitting needs google-cloud-aiplatform: pip install 't5tpu[vertex]' (or use "
            "--dry_run and `gcloud ai custom-jobs create --config`)"
        ) from None
    aiplatform.init(project=args.project, location=args.region, staging_bucket=args.staging_bucket)
    spec = job["job_spec"]
    custom_job = aiplatform.CustomJob(
        display_name=job["display_name"],
        worker_pool_specs=spec["worker_pool_specs"],
        base_output_dir=spec["base_output_directory"]["output_uri_prefix"],
    )
    custom_job.submit()
    return custom_job.resource_name


def run(args: argparse.Namespace) -> int:
    job = vertex_spec.custom_job(request(args))
    if args.dry_run:
        print(json.dumps(job, indent=2))
        return 0
    name = _submit(job, args)
    print(f"submitted {name}; MODEL_DIR {job['job_spec']['base_output_directory']}", flush=True)
    return 0
