"""Kubernetes manifests: ``launch/NAME.trainjob.yaml`` (Kubeflow Trainer v2 TrainJob on the torch-distributed
runtime) and ``launch/NAME.pytorchjob.yaml`` (the Training Operator's kubeflow.org/v1 PyTorchJob).

Both run the image's copy of the generated directory: every pod's command is ``launch/NAME.node.sh`` (see
hf_scale.generators.node_entry), which maps the operator's variables onto ``NAME.accelerate.sh``. The output
directory lives on a PersistentVolumeClaim mounted at ``cluster.output_dir`` so that a restarted pod resumes from
the newest complete checkpoint; ``terminationGracePeriodSeconds`` gives the training time to save it after SIGTERM.
The pods run as the image's non-root user, with that user's group owning the volume (fsGroup).

Every container gets ``env``: HF_HOME on the volume (a restarted pod finds the model it downloaded), then the
config's ``cluster.env`` (NCCL settings and the like), which may override it.

Restarts: a PyTorchJob restarts a failed container in place (``restartPolicy: OnFailure``: exit 75 after a
checkpoint counts as a failure) up to ``runPolicy.backoffLimit`` times, and recreates pods lost with their node.
A TrainJob cannot say whether it is restarted: that is its runtime's (the ClusterTrainingRuntime's JobSet
``failurePolicy.maxRestarts``), and runtimePatches reach only the pods. The header says so, and what to do.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from hf_scale.config.cluster_section import CONTAINER_UID, DEFAULT_IMAGE_HOME, PYTORCHJOB_CONTAINER, TRAINJOB_CONTAINER
from hf_scale.config.distributed_config import DistributedConfig
from hf_scale.generators import output_paths
from hf_scale.generators.launch import _check_name

TRAINJOB_API = "trainer.kubeflow.org/v1alpha1"
PYTORCHJOB_API = "kubeflow.org/v1"
MANAGER = "hf-scale"
"""runtimePatches' manager: who owns the patch (the TrainJob API keys patches by it)."""
OUTPUT_VOLUME = "output"
HF_CACHE = ".cache/huggingface"
"""HF_HOME under cluster.output_dir: one download per volume, kept across restarts."""


def job_name(name: str) -> str:
    """A config NAME as a Kubernetes object name (RFC 1035 label, short enough for the pods' and services'
    derived names): lowercase, '_' and '.' as '-', a leading letter, at most 40 characters."""
    _check_name(name)
    slug = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    if not slug or not slug[0].isalpha():
        slug = f"hf-{slug}".rstrip("-")
    return slug[:40].rstrip("-")


def node_command(cfg: DistributedConfig, name: str) -> tuple[list[str], list[str]]:
    """The container's command and args: NAME.node.sh in the image, the output directory on the volume, then the
    config's train.py flags."""
    script = f"{DEFAULT_IMAGE_HOME}/{output_paths.launch_file(f'{name}.node.sh')}"
    return ["bash", script], cfg.cluster.node_train_args(name)


def node_env(cfg: DistributedConfig) -> list[dict[str, str]]:
    """The containers' env: HF_HOME on the output volume, then cluster.env (which may override it)."""
    env = {"HF_HOME": cfg.cluster.on_volume(HF_CACHE), **cfg.cluster.env}
    return [{"name": name, "value": value} for name, value in env.items()]


def _gpus(cfg: DistributedConfig) -> dict[str, Any]:
    count = str(cfg.topology.processes_per_machine)
    resource = cfg.cluster.kubernetes.gpu_resource
    return {"limits": {resource: count}, "requests": {resource: count}}


def _pod_spec_extras(cfg: DistributedConfig) -> dict[str, Any]:
    """What every pod of either kind gets: grace period, non-root user owning the volume, node selection, volume."""
    kube = cfg.cluster.kubernetes
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": cfg.cluster.termination_grace_period_s,
        "securityContext": {"runAsNonRoot": True, "runAsUser": CONTAINER_UID, "runAsGroup": CONTAINER_UID,
                            "fsGroup": CONTAINER_UID},
    }
    if kube.node_selector:
        spec["nodeSelector"] = dict(kube.node_selector)
    spec["volumes"] = [{"name": OUTPUT_VOLUME, "persistentVolumeClaim": {"claimName": kube.output_claim}}]
    return spec


def _mounts(cfg: DistributedConfig) -> list[dict[str, str]]:
    return [{"name": OUTPUT_VOLUME, "mountPath": cfg.cluster.output_dir}]


def _require_image(cfg: DistributedConfig, target: str) -> str:
    if cfg.cluster.image is None:
        raise ValueError(f"cluster.image is required for the {target} target")
    return cfg.cluster.image


def trainjob(cfg: DistributedConfig, name: str) -> dict[str, Any]:
    """The TrainJob as a dict (kubeflow_trainer_api's TrainerV1alpha1TrainJob reads it back unchanged)."""
    command, args = node_command(cfg, name)
    kube = cfg.cluster.kubernetes
    pod = _pod_spec_extras(cfg)
    pod["containers"] = [{"name": TRAINJOB_CONTAINER, "volumeMounts": _mounts(cfg)}]
    return {
        "apiVersion": TRAINJOB_API,
        "kind": "TrainJob",
        "metadata": {"name": job_name(name), "namespace": kube.namespace,
                     "labels": {"app.kubernetes.io/managed-by": MANAGER}},
        "spec": {
            "runtimeRef": {"name": kube.runtime},
            "trainer": {
                "image": _require_image(cfg, "kubeflow"),
                "numNodes": cfg.topology.num_machines,
                "numProcPerNode": cfg.topology.processes_per_machine,
                "resourcesPerNode": _gpus(cfg),
                "command": command,
                "args": args,
                "env": node_env(cfg),
            },
            "runtimePatches": [{
                "manager": MANAGER,
                "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [{
                    "name": TRAINJOB_CONTAINER,
                    "template": {"spec": {"template": {"spec": pod}}},
                }]}}},
            }],
        },
    }


def pytorchjob(cfg: DistributedConfig, name: str) -> dict[str, Any]:
    """The PyTorchJob as a dict: a Master (node rank 0) and num_machines - 1 Workers, nprocPerNode processes each,
    no elastic policy (fixed membership, as the accelerate YAML)."""
    command, args = node_command(cfg, name)
    container = {
        "name": PYTORCHJOB_CONTAINER,
        "image": _require_image(cfg, "pytorchjob"),
        "command": command,
        "args": args,
        "env": node_env(cfg),
        "resources": _gpus(cfg),
        # The operator reads MASTER_PORT from this port of the Master's container.
        "ports": [{"name": "pytorchjob-port", "containerPort": cfg.topology.main_process_port}],
        "volumeMounts": _mounts(cfg),
    }
    pod = {**_pod_spec_extras(cfg), "containers": [container]}

    def replicas(count: int) -> dict[str, Any]:
        return {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": pod}}

    specs = {"Master": replicas(1)}
    if cfg.topology.num_machines > 1:
        specs["Worker"] = replicas(cfg.topology.num_machines - 1)
    return {
        "apiVersion": PYTORCHJOB_API,
        "kind": "PyTorchJob",
        "metadata": {"name": job_name(name), "namespace": cfg.cluster.kubernetes.namespace,
                     "labels": {"app.kubernetes.io/managed-by": MANAGER}},
        "spec": {
            "nprocPerNode": str(cfg.topology.processes_per_machine),
            "runPolicy": {"backoffLimit": cfg.cluster.max_restarts, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": specs,
        },
    }


def _manifest(header: str, usage: str, data: dict[str, Any]) -> str:
    comment = "".join(f"# {line}".rstrip() + "\n" for line in f"{header}\n{usage}".splitlines())
    return comment + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def trainjob_yaml(cfg: DistributedConfig, name: str, *, header: str) -> str:
    usage = f"""Submit (Kubeflow Trainer v2 with the {cfg.cluster.kubernetes.runtime} ClusterTrainingRuntime installed):
  kubectl apply -f launch/{name}.trainjob.yaml
Needs the image {cfg.cluster.image} (built from the generated Dockerfile) and a ReadWriteMany
PersistentVolumeClaim {cfg.cluster.kubernetes.output_claim} in namespace {cfg.cluster.kubernetes.namespace}.
Preemption: SIGTERM -> checkpoint -> exit 75 within terminationGracePeriodSeconds; a restarted pod resumes from
{cfg.cluster.output_dir}/{name}. Whether pods are restarted at all is NOT set by this file (a TrainJob cannot set it):
it is the runtime's JobSet failurePolicy.maxRestarts. See yours with
  kubectl get clustertrainingruntime {cfg.cluster.kubernetes.runtime} -o yaml
Without a failurePolicy a preempted TrainJob ends Failed: delete it and apply this file again; the new pods resume
from the volume. To have it restart by itself, set failurePolicy.maxRestarts in the runtime (an administrator's)."""
    return _manifest(header, usage, trainjob(cfg, name))


def pytorchjob_yaml(cfg: DistributedConfig, name: str, *, header: str) -> str:
    usage = f"""Submit (Kubeflow Training Operator v1):
  kubectl apply -f launch/{name}.pytorchjob.yaml
Needs the image {cfg.cluster.image} (built from the generated Dockerfile) and a ReadWriteMany
PersistentVolumeClaim {cfg.cluster.kubernetes.output_claim} in namespace {cfg.cluster.kubernetes.namespace}.
Preemption: SIGTERM -> checkpoint -> exit 75 within terminationGracePeriodSeconds; restartPolicy OnFailure and
runPolicy.backoffLimit={cfg.cluster.max_restarts} restart it, resuming from {cfg.cluster.output_dir}/{name}."""
    return _manifest(header, usage, pytorchjob(cfg, name))
