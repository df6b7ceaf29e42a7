"""`t5tpu vertex-submit --dry_run`: the Vertex AI CustomJob spec for TPU and GPU machines, and
`t5tpu vertex-deploy --dry_run`: the Model upload and Endpoint deployment that serve a model,
field by field, with no network; bad requests end in one line, exit 2."""

from __future__ import annotations

import json

import pytest
from cli_runs import t5tpu

from t5tpu.cli import vertex, vertex_deploy
from t5tpu.cloud import vertex_spec
from t5tpu.errors import UserError

EXPERIMENT = "configs/experiments/squad_v1_base_v2-8.gin"
IMAGE = "us-docker.pkg.dev/my-project/t5tpu/t5tpu:tpu"
COMMON = [f"--gin_file={EXPERIMENT}", f"--image={IMAGE}", "--staging_bucket=gs://my-bucket"]


def _job(*argv: str) -> dict:
    return vertex_spec.custom_job(vertex.request(vertex.parse_args([*COMMON, *argv])))


@pytest.mark.parametrize("tpu, accelerator", [("v2-8", "TPU_V2"), ("v3-8", "TPU_V3")])
def test_tpu_jobs_run_t5tpu_train_on_a_cloud_tpu(tpu, accelerator):
    job = _job(f"--tpu={tpu}", "--display_name=squad-base", "--gin.TRAIN_STEPS=1000")
    assert job["display_name"] == "squad-base"
    (pool,) = job["job_spec"]["worker_pool_specs"]
    assert pool["machine_spec"] == {
        "machine_type": "cloud-tpu",
        "accelerator_type": accelerator,
        "accelerator_count": 8,
    }
    assert pool["replica_count"] == 1
    assert pool["container_spec"] == {
        "image_uri": IMAGE,
        "args": [
            "train",
            f"--gin_file={EXPERIMENT}",
            "--gin.MODEL_DIR='gs://my-bucket/t5tpu/squad-base'",
            "--gin.TRAIN_STEPS=1000",
        ],
    }
    output = job["job_spec"]["base_output_directory"]["output_uri_prefix"]
    assert output == "gs://my-bucket/t5tpu/squad-base"


def test_a_gpu_job_with_its_own_model_dir_command_and_environment():
    job = _job(
        "--gpu=a100:8",
        "--command=eval",
        "--gin.MODEL_DIR='gs://other/run1'",
        "--gin_bindings=EVAL_BATCH_SIZE = 64",
        "--env=XLA_PYTHON_CLIENT_MEM_FRACTION=0.9",
    )
    (pool,) = job["job_spec"]["worker_pool_specs"]
    assert pool["machine_spec"] == {
        "machine_type": "a2-highgpu-8g",
        "accelerator_type": "NVIDIA_TESLA_A100",
        "accelerator_count": 8,
    }
    assert pool["container_spec"]["args"] == [
        "eval",
        f"--gin_file={EXPERIMENT}",
        "--gin.MODEL_DIR='gs://other/run1'",
        "--gin.EVAL_BATCH_SIZE=64",
    ]
    assert pool["container_spec"]["env"] == [
        {"name": "XLA_PYTHON_CLIENT_MEM_FRACTION", "value": "0.9"}
    ]
    assert job["job_spec"]["base_output_directory"]["output_uri_prefix"] == "gs://other/run1"


def test_dry_run_prints_the_spec_as_json_without_network():
    run = t5tpu("vertex-submit", *COMMON, "--tpu=v3-8", "--dry_run")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == _job("--tpu=v3-8")
    assert not run.stderr.strip()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tpu=v4-8"], "invalid choice"),
        (["--gpu=a100:3"], "a100:3"),
        (["--tpu=v2-8", "--gpu=a100:1"], "not allowed with"),
        (["--tpu=v2-8", "--staging_bucket=my-bucket"], "gs://BUCKET"),
        (["--tpu=v2-8", "--gin_file=my_experiment.gin"], "not a shipped config"),
        (["--tpu=v2-8", "--env=NOVALUE"], "NAME=VALUE"),
    ],
)
def test_bad_requests_are_one_line_exit_2(argv, message):
    run = t5tpu("vertex-submit", *COMMON, *argv, "--dry_run")
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("t5tpu: error: ") and message in lines[0]
    assert not run.stdout


def test_gs_gin_files_are_taken_as_given():
    job = _job("--tpu=v2-8", "--gin_file=gs://my-bucket/gin/mine.gin")
    args = job["job_spec"]["worker_pool_specs"][0]["container_spec"]["args"]
    assert "--gin_file=gs://my-bucket/gin/mine.gin" in args


def test_submitting_without_the_vertex_extra_says_how_to_install_it(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_google(name, *args, **kwargs):
        if name.startswith("google.cloud"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_google)
    args = vertex.parse_args([*COMMON, "--tpu=v2-8"])
    with pytest.raises(UserError, match=r"t5tpu\[vertex\]"):
        vertex.run(args)


# --- `t5tpu vertex-deploy`: the Model upload and Endpoint deployment of `t5tpu serve` ---------

SERVE_EXPERIMENT = "configs/experiments/qp_is_duplicate_tiny_cpu.gin"
DEPLOY = ["--model_dir=gs://my-bucket/t5tpu/qp", f"--image={IMAGE}"]


def _deployment(*argv: str) -> dict:
    return vertex_spec.deployment(vertex_deploy.request(vertex_deploy.parse_args([*DEPLOY, *argv])))


def test_a_deployment_serves_the_model_dir_with_t5tpu_serve_on_a_cpu_machine():
    spec = _deployment(
        f"--gin_file={SERVE_EXPERIMENT}",
        "--gin.NUM_BEAMS=4",
        "--serve_flag=--max_batch_size=64",
        "--display_name=qp",
        "--env=XLA_FLAGS=--xla_cpu_multi_thread_eigen=true",
    )
    model = spec["model_upload"]["model"]
    assert model["display_name"] == "qp"
    assert model["artifact_uri"] == "gs://my-bucket/t5tpu/qp"  # the container's AIP_STORAGE_URI
    assert model["container_spec"] == {
        "image_uri": IMAGE,
        "args": [
            "serve",
            "--host=0.0.0.0",
            f"--gin_file={SERVE_EXPERIMENT}",
            "--gin.NUM_BEAMS=4",
            "--max_batch_size=64",
        ],
        "ports": [{"container_port": 8080}],
        "predict_route": "/v1/predict",
        "health_route": "/health",
        "env": [{"name": "XLA_FLAGS", "value": "--xla_cpu_multi_thread_eigen=true"}],
    }
    assert spec["endpoint"] == {"display_name": "qp"}
    assert spec["deploy"] == {
        "deployed_model": {
            "model": vertex_spec.UPLOADED_MODEL,
            "display_name": "qp",
            "dedicated_resources": {
                "machine_spec": {"machine_type": "n1-standard-4"},
                "min_replica_count": 1,
                "max_replica_count": 1,
            },
        },
        "traffic_split": {"0": 100},
    }


@pytest.mark.parametrize(
    "argv, machine",
    [
        (["--tpu=v5e-1"], {"machine_type": "ct5lp-hightpu-1t"}),
        (
            ["--gpu=l4:1"],
            {
                "machine_type": "g2-standard-8",
                "accelerator_type": "NVIDIA_L4",
                "accelerator_count": 1,
            },
        ),
        (["--machine_type=n1-highmem-8"], {"machine_type": "n1-highmem-8"}),
    ],
)
def test_deployments_on_tpu_gpu_and_other_cpu_machines(argv, machine):
    spec = _deployment(*argv, "--min_replicas=1", "--max_replicas=3")
    resources = spec["deploy"]["deployed_model"]["dedicated_resources"]
    assert resources == {"machine_spec": machine, "min_replica_count": 1, "max_replica_count": 3}


def test_deploy_dry_run_prints_the_spec_as_json_without_network():
    run = t5tpu("vertex-deploy", *DEPLOY, "--tpu=v5e-4", "--dry_run")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == _deployment("--tpu=v5e-4")
    assert not run.stderr.strip()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model_dir=/tmp/qp"], "gs://BUCKET/PATH"),
        (["--tpu=v2-8"], "invalid choice"),
        (["--tpu=v5e-1", "--gpu=l4:1"], "not allowed with"),
        (["--gpu=a100:3"], "a100:3"),
        (["--gin.MODEL_DIR='gs://other/run'"], "drop --gin.MODEL_DIR"),
        (["--serve_flag=--port=9000"], "host, port and model are Vertex AI's"),
        (["--min_replicas=2", "--max_replicas=1"], "--min_replicas"),
        (["--gin_file=my_experiment.gin"], "not a shipped config"),
    ],
)
def test_bad_deployments_are_one_line_exit_2(argv, message):
    run = t5tpu("vertex-deploy", *DEPLOY, *argv, "--dry_run")
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("t5tpu: error: ") and message in lines[0]
    assert not run.stdout


def test_deploying_without_the_vertex_extra_says_how_to_install_it(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_google(name, *args, **kwargs):
        if name.startswith("google.cloud"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_google)
    with pytest.raises(UserError, match=r"t5tpu\[vertex\]"):
        vertex_deploy.run(vertex_deploy.parse_args(DEPLOY))
