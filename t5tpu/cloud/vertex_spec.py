"""Vertex AI resources for the t5tpu container, as plain dicts built without any Google client
or network: the CustomJob that runs a t5tpu command on a TPU or GPU machine (what `gcloud ai
custom-jobs create --config` and google-cloud-aiplatform's CustomJob take), and the Model upload
and Endpoint deployment that serve a model with `t5tpu serve`.
"""

from __future__ import annotations

import dataclasses
import re

from t5tpu.errors import UserError

# Vertex AI's TPU machines: the legacy TPU nodes (machine type cloud-tpu with an accelerator)
# and the TPU v5e machines, whose type names the chips a host has.
TPU_MACHINES = {
    "v2-8": {"machine_type": "cloud-tpu", "accelerator_type": "TPU_V2", "accelerator_count": 8},
    "v3-8": {"machine_type": "cloud-tpu", "accelerator_type": "TPU_V3", "accelerator_count": 8},
    "v5e-1": {"machine_type": "ct5lp-hightpu-1t", "tpu_topology": "1x1"},
    "v5e-4": {"machine_type": "ct5lp-hightpu-4t", "tpu_topology": "2x2"},
    "v5e-8": {"machine_type": "ct5lp-hightpu-8t", "tpu_topology": "2x4"},
}
# (GPU, count) -> (machine type, accelerator type), the machines that hold that many.
GPU_MACHINES = {
    ("a100", 1): ("a2-highgpu-1g", "NVIDIA_TESLA_A100"),
    ("a100", 2): ("a2-highgpu-2g", "NVIDIA_TESLA_A100"),
    ("a100", 4): ("a2-highgpu-4g", "NVIDIA_TESLA_A100"),
    ("a100", 8): ("a2-highgpu-8g", "NVIDIA_TESLA_A100"),
    ("h100", 8): ("a3-highgpu-8g", "NVIDIA_H100_80GB"),
    ("l4", 1): ("g2-standard-8", "NVIDIA_L4"),
}
COMMANDS = ("train", "eval", "infer")
_DISPLAY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


@dataclasses.dataclass(frozen=True)
class JobRequest:
    """What the user asked for, checked by `check` before a spec is built."""

    command: str
    gin_files: tuple[str, ...]
    bindings: tuple[str, ...]
    image: str
    staging_bucket: str
    display_name: str
    tpu: str | None = None
    gpu: str | None = None
    env: tuple[str, ...] = ()

    def check(self) -> None:
        if self.command not in COMMANDS:
            raise UserError(f"--command={self.command}; choose one of {', '.join(COMMANDS)}")
        if (self.tpu is None) == (self.gpu is None):
            raise UserError("give one of --tpu=v3-8 or --gpu=a100:1")
        if self.tpu is not None and self.tpu not in TPU_MACHINES:
            raise UserError(f"--tpu={self.tpu}; Vertex AI offers {', '.join(TPU_MACHINES)}")
        if self.gpu is not None:
            gpu_machine(self.gpu)
        if not re.fullmatch(r"gs://[a-z0-9][a-z0-9._-]{1,220}(/.*)?", self.staging_bucket):
            raise UserError(
                f"--staging_bucket={self.staging_bucket} is not a gs://BUCKET[/PATH] path"
            )
        if not self.image or " " in self.image:
            raise UserError(f"--image={self.image!r}: give the pushed image URI")
        if not _DISPLAY_NAME.fullmatch(self.display_name):
            raise UserError(f"--display_name={self.display_name!r}: letters, digits, . _ -")
        for entry in self.env:
            if "=" not in entry:
                raise UserError(f"--env={entry}: write NAME=VALUE")

    @property
    def model_dir(self) -> str:
        """MODEL_DIR: bound by the user, else a folder named for the job in the bucket."""
        for binding in self.bindings:
            name, _, value = binding.partition("=")
            if name.strip() == "MODEL_DIR":
                return value.strip().strip("'\"")
        return f"{self.staging_bucket.rstrip('/')}/t5tpu/{self.display_name}"


def gpu_machine(gpu: str) -> tuple[str, str, int]:
    """(machine type, accelerator type, count) for --gpu=NAME:COUNT."""
    name, _, count = gpu.partition(":")
    key = (name.lower(), int(count) if count.isdigit() else 1)
    if key not in GPU_MACHINES:
        offered = ", ".join(f"{n}:{c}" for n, c in GPU_MACHINES)
        raise UserError(f"--gpu={gpu}; t5tpu knows the machines for {offered}")
    machine_type, accelerator = GPU_MACHINES[key]
    return machine_type, accelerator, key[1]


def machine_spec(request: JobRequest) -> dict:
    if request.tpu is not None:
        return dict(TPU_MACHINES[request.tpu])
    machine_type, accelerator, count = gpu_machine(request.gpu)
    return {
        "machine_type": machine_type,
        "accelerator_type": accelerator,
        "accelerator_count": count,
    }


def container_args(request: JobRequest) -> list[str]:
    """The t5tpu command line the container runs (its entrypoint is `t5tpu`)."""
    bindings = [b for b in request.bindings if b.partition("=")[0].strip() != "MODEL_DIR"]
    return [
        request.command,
        *(f"--gin_file={path}" for path in request.gin_files),
        f"--gin.MODEL_DIR='{request.model_dir}'",
        *(f"--gin.{binding}" for binding in bindings),
    ]


def custom_job(request: JobRequest) -> dict:
    """The CustomJob resource for `request` (checked first)."""
    request.check()
    env = [dict(zip(("name", "value"), e.split("=", 1), strict=True)) for e in request.env]
    container = {"image_uri": request.image, "args": container_args(request)}
    if env:
        container["env"] = env
    return {
        "display_name": request.display_name,
        "job_spec": {
            "worker_pool_specs": [
                {
                    "machine_spec": machine_spec(request),
                    "replica_count": 1,
                    "container_spec": container,
                }
            ],
            "base_output_directory": {"output_uri_prefix": request.model_dir},
        },
    }


# --- online prediction: `t5tpu vertex-deploy` ------------------------------------------------

# The TPU machines Vertex AI serves predictions on (v5e); the legacy cloud-tpu nodes train only.
PREDICTION_TPUS = {
    "v5e-1": "ct5lp-hightpu-1t",
    "v5e-4": "ct5lp-hightpu-4t",
    "v5e-8": "ct5lp-hightpu-8t",
}
DEFAULT_PREDICTION_MACHINE = "n1-standard-4"
# What `t5tpu serve` listens on in the container (Vertex AI sets AIP_HTTP_PORT to it).
SERVE_PORT = 8080
PREDICT_ROUTE = "/v1/predict"
HEALTH_ROUTE = "/health"
# The uploaded model's resource name is known only once uploaded: the deploy request names it so.
UPLOADED_MODEL = "{uploaded model}"


@dataclasses.dataclass(frozen=True)
class DeployRequest:
    """A model to upload and deploy to a new endpoint, checked by `check`."""

    model_dir: str  # the artifacts Vertex AI copies for the container (AIP_STORAGE_URI)
    image: str
    display_name: str
    gin_files: tuple[str, ...] = ()
    bindings: tuple[str, ...] = ()
    serve_flags: tuple[str, ...] = ()
    machine_type: str | None = None
    tpu: str | None = None
    gpu: str | None = None
    min_replicas: int = 1
    max_replicas: int = 1
    env: tuple[str, ...] = ()

    def check(self) -> None:
        if not re.fullmatch(r"gs://[a-z0-9][a-z0-9._-]{1,220}(/.*)?", self.model_dir):
            raise UserError(
                f"--model_dir={self.model_dir}: Vertex AI copies a model from gs://BUCKET/PATH"
            )
        if sum(x is not None for x in (self.tpu, self.gpu, self.machine_type)) > 1:
            raise UserError("give at most one of --tpu, --gpu and --machine_type")
        if self.tpu is not None and self.tpu not in PREDICTION_TPUS:
            offered = ", ".join(PREDICTION_TPUS)
            raise UserError(f"--tpu={self.tpu}; Vertex AI serves predictions on {offered}")
        if self.gpu is not None:
            gpu_machine(self.gpu)
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise UserError("--min_replicas must be >= 1 and <= --max_replicas")
        if not self.image or " " in self.image:
            raise UserError(f"--image={self.image!r}: give the pushed image URI")
        if not _DISPLAY_NAME.fullmatch(self.display_name):
            raise UserError(f"--display_name={self.display_name!r}: letters, digits, . _ -")
        for binding in self.bindings:
            if binding.partition("=")[0].strip() == "MODEL_DIR":
                raise UserError(
                    "the container serves --model_dir (AIP_STORAGE_URI): drop --gin.MODEL_DIR"
                )
        for flag in self.serve_flags:
            if not flag.startswith("--") or flag.split("=")[0] in ("--host", "--port", "--model"):
                raise UserError(
                    f"--serve_flag={flag}: pass a `t5tpu serve` flag such as "
                    "--max_batch_size=64 (host, port and model are Vertex AI's)"
                )
        for entry in self.env:
            if "=" not in entry:
                raise UserError(f"--env={entry}: write NAME=VALUE")


def prediction_machine(request: DeployRequest) -> dict:
    if request.tpu is not None:
        return {"machine_type": PREDICTION_TPUS[request.tpu]}
    if request.gpu is not None:
        machine_type, accelerator, count = gpu_machine(request.gpu)
        return {
            "machine_type": machine_type,
            "accelerator_type": accelerator,
            "accelerator_count": count,
        }
    return {"machine_type": request.machine_type or DEFAULT_PREDICTION_MACHINE}


def serving_container(request: DeployRequest) -> dict:
    """The container spec: `t5tpu serve` on every interface of the container, its port and
    routes as Vertex AI calls them."""
    container = {
        "image_uri": request.image,
        "args": [
            "serve",
            "--host=0.0.0.0",
            *(f"--gin_file={path}" for path in request.gin_files),
            *(f"--gin.{binding}" for binding in request.bindings),
            *request.serve_flags,
        ],
        "ports": [{"container_port": SERVE_PORT}],
        "predict_route": PREDICT_ROUTE,
        "health_route": HEALTH_ROUTE,
    }
    if request.env:
        container["env"] = [
            dict(zip(("name", "value"), e.split("=", 1), strict=True)) for e in request.env
        ]
    return container


def deployment(request: DeployRequest) -> dict:
    """The three calls a deployment makes: upload the Model (models.upload), create the
    Endpoint, deploy the model to it (endpoints.deployModel) with all traffic."""
    request.check()
    return {
        "model_upload": {
            "model": {
                "display_name": request.display_name,
                "artifact_uri": request.model_dir,
                "container_spec": serving_container(request),
            }
        },
        "endpoint": {"display_name": request.display_name},
        "deploy": {
            "deployed_model": {
                "model": UPLOADED_MODEL,
                "display_name": request.display_name,
                "dedicated_resources": {
                    "machine_spec": prediction_machine(request),
                    "min_replica_count": request.min_replicas,
                    "max_replica_count": request.max_replicas,
                },
            },
            "traffic_split": {"0": 100},
        },
    }
