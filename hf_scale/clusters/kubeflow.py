"""The ``kubeflow`` target: ``launch/NAME.trainjob.yaml``, a Kubeflow Trainer v2 TrainJob on the torch-distributed
runtime (hf_scale.clusters.kubernetes has what it shares with the PyTorchJob).

A TrainJob cannot say whether it is restarted: that is its runtime's (the ClusterTrainingRuntime's JobSet
``failurePolicy.maxRestarts``), and runtimePatches reach only the pods. The header says so, and what to do.
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
from hf_scale.config.cluster_section import TRAINJOB_CONTAINER
from hf_scale.config.distributed_config import DistributedConfig
from hf_scale.generators import output_paths

NAME = "kubeflow"
TRAINJOB_API = "trainer.kubeflow.org/v1alpha1"
KIND = "TrainJob"


def trainjob(cfg: DistributedConfig, name: str) -> dict[str, Any]:
    """The TrainJob as a dict (kubeflow_trainer_api's TrainerV1alpha1TrainJob reads it back unchanged)."""
    command, args = node_command(cfg, name)
    kube = cfg.cluster.kubernetes
    pod = pod_spec_extras(cfg)
    pod["containers"] = [{"name": TRAINJOB_CONTAINER, "volumeMounts": mounts(cfg)}]
    return {
        "apiVersion": TRAINJOB_API,
        "kind": KIND,
        "metadata": {"name": job_name(name), "namespace": kube.namespace,
                     "labels": {"app.kubernetes.io/managed-by": MANAGER}},
        "spec": {
            "runtimeRef": {"name": kube.runtime},
            "trainer": {
                "image": require_image(cfg, NAME),
                "numNodes": cfg.topology.num_machines,
                "numProcPerNode": cfg.topology.processes_per_machine,
                "resourcesPerNode": gpus(cfg),
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
    return manifest_text(header, usage, trainjob(cfg, name))


def files(cfg: DistributedConfig, name: str, *, header: str) -> dict[str, str]:
    """``launch/NAME.trainjob.yaml``."""
    return {output_paths.launch_file(f"{name}.trainjob.yaml"): trainjob_yaml(cfg, name, header=header)}


TARGET = ClusterTarget(
    name=NAME,
    writes="DIR/launch/NAME.trainjob.yaml",
    summary="Kubeflow Trainer v2 TrainJob (kubectl apply -f)",
    files=files,
    doc_anchor="kubeflow-trainer-trainjob",
    node_script=True,
    image=True,
    source=True,
    manifests=(ManifestKind(KIND, "a TrainJob", lambda data: isinstance(data, dict) and data.get("kind") == KIND,
                            "spec.trainer", "kind:"),),
)
