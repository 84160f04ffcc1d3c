"""What the two Kubernetes targets share (hf_scale.clusters.kubeflow: ``launch/NAME.trainjob.yaml``, a Kubeflow
Trainer v2 TrainJob on the torch-distributed runtime; hf_scale.clusters.pytorchjob: ``launch/NAME.pytorchjob.yaml``,
the Training Operator's kubeflow.org/v1 PyTorchJob); not a target itself.

Both run the image's copy of the generated directory: every pod's command is ``launch/NAME.node.sh`` (see
hf_scale.generators.node_entry), which maps the operator's variables onto ``NAME.accelerate.sh``. The output
directory lives on a PersistentVolumeClaim mounted at ``cluster.output_dir`` so that a restarted pod resumes from
the newest complete checkpoint; ``terminationGracePeriodSeconds`` gives the training time to save it after SIGTERM.
The pods run as the image's non-root user, with that user's group owning the volume (fsGroup).

Every container gets ``env``: HF_HOME on the volume (a restarted pod finds the model it downloaded), then the
config's ``cluster.env`` (NCCL settings and the like), which may override it.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from hf_scale.config.cluster_section import CONTAINER_UID, DEFAULT_IMAGE_HOME
from hf_scale.config.distributed_config import DistributedConfig
from hf_scale.generators import output_paths
from hf_scale.generators.launch import _check_name

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


def gpus(cfg: DistributedConfig) -> dict[str, Any]:
    """Every node's GPUs as a Kubernetes resource limit and request (cluster.kubernetes.gpu_resource)."""
    count = str(cfg.topology.processes_per_machine)
    resource = cfg.cluster.kubernetes.gpu_resource
    return {"limits": {resource: count}, "requests": {resource: count}}


def pod_spec_extras(cfg: DistributedConfig) -> dict[str, Any]:
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


def mounts(cfg: DistributedConfig) -> list[dict[str, str]]:
    """The container's mount of the output volume at cluster.output_dir."""
    return [{"name": OUTPUT_VOLUME, "mountPath": cfg.cluster.output_dir}]


def require_image(cfg: DistributedConfig, target: str) -> str:
    """cluster.image, which the target's pods run (generate refuses a config without it first, in one line)."""
    if cfg.cluster.image is None:
        raise ValueError(f"cluster.image is required for the {target} target")
    return cfg.cluster.image


def manifest_text(header: str, usage: str, data: dict[str, Any]) -> str:
    """The manifest as YAML under its header and usage, both as comments."""
    comment = "".join(f"# {line}".rstrip() + "\n" for line in f"{header}\n{usage}".splitlines())
    return comment + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
