"""The TrainJob and PyTorchJob manifests, read back by Kubeflow's own API models: kubeflow_trainer_api's
TrainerV1alpha1TrainJob (pydantic, strict types) and the Training Operator SDK's KubeflowOrgV1PyTorchJob (with the
Kubernetes client's pod models). A model drops what it does not know, so the manifest must come back unchanged."""

from __future__ import annotations

import pytest
import yaml
from cluster_helpers import CONFIGS, IMAGE, generate_all
from kubeflow.training.api_client import ApiClient
from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

from hf_scale.clusters import kubeflow, kubernetes, pytorchjob
from hf_scale.commands.cli import main
from hf_scale.config.distributed_config import load_config


def trainjob_round_trip(data: dict) -> dict:
    return TrainerV1alpha1TrainJob.from_dict(data).to_dict()


def pytorchjob_round_trip(data: dict) -> dict:
    client = ApiClient()
    return client.sanitize_for_serialization(client._ApiClient__deserialize(data, "KubeflowOrgV1PyTorchJob"))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_manifests_are_what_kubeflow_models_read(name, tmp_path):
    root = generate_all(tmp_path, name)
    cfg = load_config(root / "hf_scale_configs" / f"{name}.yaml")
    trainjob = yaml.safe_load((root / "launch" / f"{name}.trainjob.yaml").read_text())
    assert trainjob_round_trip(trainjob) == trainjob
    trainer = trainjob["spec"]["trainer"]
    assert trainer["numNodes"] == cfg.topology.num_machines
    assert trainer["numProcPerNode"] == cfg.topology.processes_per_machine
    assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": str(cfg.topology.processes_per_machine)}
    assert trainer["image"] == IMAGE
    assert trainer["args"][:2] == ["--output_dir", f"/output/{name}"]
    assert trainer["args"][2:] == cfg.cluster.train_args
    pod = trainjob["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert pod["template"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 600
    assert trainer["env"] == kubernetes.node_env(cfg)
    assert trainer["env"][0] == {"name": "HF_HOME", "value": "/output/.cache/huggingface"}  # on the volume

    job = yaml.safe_load((root / "launch" / f"{name}.pytorchjob.yaml").read_text())
    assert pytorchjob_round_trip(job) == job
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert sum(spec["replicas"] for spec in specs.values()) == cfg.topology.num_machines
    assert job["spec"]["nprocPerNode"] == str(cfg.topology.processes_per_machine)
    assert "elasticPolicy" not in job["spec"]
    container = specs["Master"]["template"]["spec"]["containers"][0]
    assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": cfg.topology.main_process_port}]
    assert specs["Master"]["restartPolicy"] == "OnFailure"
    assert container["env"] == trainer["env"]
    assert job["spec"]["runPolicy"]["backoffLimit"] == cfg.cluster.max_restarts


def test_the_models_catch_what_kubeflow_would_refuse():
    cfg = load_config(overrides=[f"cluster.image={IMAGE}"])
    trainjob = kubeflow.trainjob(cfg, "run")
    trainjob["spec"]["trainer"]["numNode"] = 2  # misspelled: dropped by the model
    assert trainjob_round_trip(trainjob) != trainjob
    trainjob["spec"]["trainer"]["numNodes"] = "2"  # a string where the API wants an integer
    with pytest.raises(ValueError):
        trainjob_round_trip(trainjob)
    job = pytorchjob.pytorchjob(cfg, "run")
    job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["imag"] = IMAGE
    assert pytorchjob_round_trip(job) != job


def test_job_names_are_kubernetes_names():
    assert kubernetes.job_name("My_Run.v2") == "my-run-v2"
    assert kubernetes.job_name("7b") == "hf-7b"
    assert len(kubernetes.job_name("a" * 100)) == 40


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_image_targets_need_a_pinned_image(tmp_path, capsys):
    out = ["--output-dir", str(tmp_path)]
    err = _refused(["generate", "--preset", "ddp", "--targets", "kubeflow", *out], capsys)
    assert "--targets kubeflow needs cluster.image" in err
    err = _refused(["generate", "--preset", "ddp", "--set", "cluster.image=hf-scale:latest", "--targets", "pytorchjob",
                    *out], capsys)
    assert "cluster.image='hf-scale:latest' is invalid: uses the tag `latest`" in err
    err = _refused(["generate", "--preset", "ddp", "--targets", "kubeflow,k8s", *out], capsys)
    assert "unknown target 'k8s'" in err
    assert not list(tmp_path.iterdir())  # nothing written


def test_cluster_env_reaches_every_container_and_may_override_hf_home(tmp_path):
    cfg = load_config(overrides=[f"cluster.image={IMAGE}", "cluster.output_dir=/mnt/runs",
                                 "cluster.env={NCCL_SOCKET_IFNAME: eth0, HF_HOME: /cache/hf}"])
    want = [{"name": "HF_HOME", "value": "/cache/hf"}, {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"}]
    trainjob = kubeflow.trainjob(cfg, "run")
    assert trainjob["spec"]["trainer"]["env"] == want
    assert trainjob_round_trip(trainjob) == trainjob  # an EnvVar list the TrainJob API reads
    job = pytorchjob.pytorchjob(cfg, "run")
    assert all(spec["template"]["spec"]["containers"][0]["env"] == want
               for spec in job["spec"]["pytorchReplicaSpecs"].values())
    assert pytorchjob_round_trip(job) == job
    assert kubernetes.node_env(load_config(overrides=["cluster.output_dir=/mnt/runs"]))[0]["value"] == (
        "/mnt/runs/.cache/huggingface")


def test_the_trainjob_says_that_restarts_are_the_runtimes(tmp_path):
    """A TrainJob cannot set its restarts (runtimePatches reach only the pods): its header says so and what to do."""
    text = (generate_all(tmp_path, "one", "kubeflow") / "launch" / "one.trainjob.yaml").read_text()
    header = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    assert "is NOT set by this file" in header and "failurePolicy.maxRestarts" in header
    assert "kubectl get clustertrainingruntime torch-distributed -o yaml" in header
    assert "delete it and apply this file again" in header


def test_switches_and_paths_named_like_secrets_are_not_secrets():
    """Only a name ending like a credential with a value that is not a switch is refused (TOKENIZERS_PARALLELISM,
    HF_TOKEN_PATH and HF_HUB_DISABLE_IMPLICIT_TOKEN=1 are settings, not secrets)."""
    from hf_scale.config.cluster_section import reserved_env_problem, secret_env_problem

    env = {"TOKENIZERS_PARALLELISM": "false", "HF_TOKEN_PATH": "/secrets/token", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
           "NCCL_SOCKET_IFNAME": "eth0", "HF_SCALE_VERBOSE": "1"}
    cfg = load_config(overrides=[f"cluster.env={env}"])
    assert cfg.cluster.env == env
    assert secret_env_problem("HUGGING_FACE_HUB_TOKEN", "hf_x") and secret_env_problem("AWS_SECRET_ACCESS_KEY", "x")
    # Not only the long endings: a short last word (GITHUB_PAT), a secret word before a qualifier (DB_PASSWORD_PROD),
    # a number (987654321 is a password too), a value spelled like a token under any name.
    for name, value in [("GITHUB_PAT", "x"), ("DB_PASSWORD_PROD", "x"), ("DB_PASSWORD", 987654321),
                        ("SMTP_PASS", "x"), ("GITLAB_TOKEN_RO", "x"), ("MY_SETTING", "hf_" + "a" * 34)]:
        assert secret_env_problem(name, value), name
    for name in ("COMPAT", "PWD", "MAX_TOKEN_LENGTH", "TOKEN_URL"):
        assert secret_env_problem(name, "x") is None, name
    assert reserved_env_problem("TORCHELASTIC_RESTART_COUNT") and reserved_env_problem("LOCAL_RANK")
    assert reserved_env_problem("NCCL_DEBUG") is None
