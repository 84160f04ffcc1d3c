"""The ``pytorchjob`` target: ``launch/NAME.pytorchjob.yaml``, the Training Operator's kubeflow.org/v1 PyTorchJob
(hf_scale.clusters.kubernetes has what it shares with the TrainJob).

Restarts: a PyTorchJob restarts a failed container in place (``restartPolicy: OnFailure``: exit 75 after a
checkpoint counts as a failure) up to ``runPolicy.backoffLimit`` times, and recreates pods lost with their node.
"""

from __future__ import annotations

from typing import Any

from hf_scale.clusters.kubernetes import (
    MANAGER,
    gpus,
    job_name,
    manifest_text,
    mounts,
    node_command,
    node_env,
    pod_spec_extras,
    require_image,
)
from hf_scale.clusters.target import ClusterTarget, ManifestKind
from hf_scale.config.cluster_section import PYTORCHJOB_CONTAINER
from hf_scale.config.distributed_config import DistributedConfig
from hf_scale.generators import output_paths

NAME = "pytorchjob"
PYTORCHJOB_API = "kubeflow.org/v1"
KIND = "PyTorchJob"


def pytorchjob(cfg: DistributedConfig, name: str) -> dict[str, Any]:
    """The PyTorchJob as a dict: a Master (node rank 0) and num_machines - 1 Workers, nprocPerNode processes each,
    no elastic policy (fixed membership, as the accelerate YAML)."""
    command, args = node_command(cfg, name)
    container = {
        "name": PYTORCHJOB_CONTAINER,
        "image": require_image(cfg, NAME),
        "command": command,
        "args": args,
        "env": node_env(cfg),
        "resources": gpus(cfg),
        # The operator reads MASTER_PORT from this port of the Master's container.
        "ports": [{"name": "pytorchjob-port", "containerPort": cfg.topology.main_process_port}],
        "volumeMounts": mounts(cfg),
    }
    pod = {**pod_spec_extras(cfg), "containers": [container]}

    def replicas(count: int) -> dict[str, Any]:
        return {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": pod}}

    specs = {"Master": replicas(1)}
    if cfg.topology.num_machines > 1:
        specs["Worker"] = replicas(cfg.topology.num_machines - 1)
    return {
        "apiVersion": PYTORCHJOB_API,
        "kind": KIND,
        "metadata": {"name": job_name(name), "namespace": cfg.cluster.kubernetes.namespace,
                     "labels": {"app.kubernetes.io/managed-by": MANAGER}},
        "spec": {
            "nprocPerNode": str(cfg.topology.processes_per_machine),
            "runPolicy": {"backoffLimit": cfg.cluster.max_restarts, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": specs,
        },
    }


def pytorchjob_yaml(cfg: DistributedConfig, name: str, *, header: str) -> str:
    usage = f"""Submit (Kubeflow Training Operator v1):
  kubectl apply -f launch/{name}.pytorchjob.yaml
Needs the image {cfg.cluster.image} (built from the generated Dockerfile) and a ReadWriteMany
PersistentVolumeClaim {cfg.cluster.kubernetes.output_claim} in namespace {cfg.cluster.kubernetes.namespace}.
Preemption: SIGTERM -> checkpoint -> exit 75 within terminationGracePeriodSeconds; restartPolicy OnFailure and
runPolicy.backoffLimit={cfg.cluster.max_restarts} restart it, resuming from {cfg.cluster.output_dir}/{name}."""
    return manifest_text(header, usage, pytorchjob(cfg, name))


def files(cfg: DistributedConfig, name: str, *, header: str) -> dict[str, str]:
    """``launch/NAME.pytorchjob.yaml``."""
    return {output_paths.launch_file(f"{name}.pytorchjob.yaml"): pytorchjob_yaml(cfg, name, header=header)}


TARGET = ClusterTarget(
    name=NAME,
    writes="DIR/launch/NAME.pytorchjob.yaml",
    summary="Training Operator PyTorchJob (kubectl apply -f)",
    files=files,
    doc_anchor="training-operator-pytorchjob",
    node_script=True,
    image=True,
    source=True,
    manifests=(ManifestKind(KIND, "a PyTorchJob", lambda data: isinstance(data, dict) and data.get("kind") == KIND,
                            "spec", "kind:"),),
)
