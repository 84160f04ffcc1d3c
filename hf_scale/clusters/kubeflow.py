"""The ``kubeflow`` target: ``launch/NAME.trainjob.yaml``, a Kubeflow Trainer v2 TrainJob on the torch-distributed
runtime (hf_scale.clusters.kubernetes has what it shares with the PyTorchJob).

A TrainJob cannot say whether it is restarted: that is its runtime's (the ClusterTrainingRuntime's JobSet
``failurePolicy.maxRestarts``), and runtimePatches reach only the pods. The header says so, and what to do.

`hf-scale check --manifest` reads a TrainJob's fields with :func:`manifest_fields` (the trainer's command, the pods
of its runtimePatches) and validates it with :func:`manifest_problem` (kubeflow_trainer_api's TrainJob model, then
the CRD's rules); a TrainJob may leave spec.trainer.image out (:func:`missing_image`: its runtime supplies one).
"""

from __future__ import annotations

from typing import Any

from hf_scale.clusters.kubernetes import (
    MANAGER,
    NODE_VARIABLES,
    REFUSED_BY,
    SECRET_VIA,
    gpus,
    job_name,
    manifest_fields,
    manifest_text,
    model_problem,
    mounts,
    node_command,
    node_env,
    object_problem,
    pod_spec_extras,
    require_image,
)
from hf_scale.clusters.target import ClusterTarget, ManifestFields, ManifestKind, ManifestNote
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


def _pods(spec: dict) -> list[dict]:
    """The pod specs of the TrainJob's runtimePatches (what it sets of its runtime's pods)."""
    pods = []
    for patch in spec.get("runtimePatches") or []:
        jobset = ((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}
        for job in jobset.get("replicatedJobs") or []:
            pod = (((job.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec")
            if pod:
                pods.append(pod)
    return pods


def trainjob_fields(data: dict) -> ManifestFields:
    """What a TrainJob says: spec.trainer runs the command (numNodes, numProcPerNode, resourcesPerNode, image,
    command, args, env); its runtimePatches' pods have the volumes and grace periods."""
    spec = data.get("spec") or {}
    pods = _pods(spec)
    trainer = spec.get("trainer") or {}
    return manifest_fields(pods, trainer, nodes=trainer.get("numNodes"), procs=trainer.get("numProcPerNode"),
                           procs_at="spec.trainer.numProcPerNode", resources=trainer.get("resourcesPerNode") or {})


def _read_back(data: dict) -> dict:
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    return TrainerV1alpha1TrainJob.from_dict(data).to_dict()


def _rule_problem(data: dict) -> str | None:
    """Any Kubeflow object's rules (hf_scale.clusters.kubernetes.object_problem), then the TrainJob's own:
    spec.runtimeRef is required (TrainJobSpec), so a TrainJob without a spec runs nothing."""
    problem = object_problem(KIND, TRAINJOB_API, data)
    if problem:
        return problem
    spec = data.get("spec")
    if not isinstance(spec, dict) or not spec.get("runtimeRef"):
        return "spec.runtimeRef is missing: the TrainJob names no training runtime (a spec with runtimeRef.name)"
    return None


def trainjob_problem(data: dict) -> str | None:
    """What Kubeflow Trainer refuses in a TrainJob: kubeflow_trainer_api's TrainJob model, then the CRD's rules."""
    return model_problem(KIND, data, _read_back, _rule_problem)


def missing_image(data: dict, runs_hf_scale: bool, file: str) -> ManifestNote | None:
    """A TrainJob may leave spec.trainer.image out: its training runtime supplies the image, which check cannot
    see; whether it has hf_scale is the point, said (a warning) when the command runs hf_scale."""
    if not runs_hf_scale:
        return None
    runtime = ((data.get("spec") or {}).get("runtimeRef") or {}).get("name")
    return ManifestNote("spec.trainer.image",
                        f"no spec.trainer.image: the training runtime {runtime!r} supplies the image, and the command "
                        "runs hf_scale, which that image must have installed (check cannot see the runtime's image)",
                        f"set spec.trainer.image in {file} to a pinned image with hf_scale (hf-scale generate writes "
                        "its Dockerfile), or make sure the runtime's image has it", warning=True)


TARGET = ClusterTarget(
    name=NAME,
    writes="DIR/launch/NAME.trainjob.yaml",
    summary="Kubeflow Trainer v2 TrainJob (kubectl apply -f)",
    files=files,
    doc_anchor="kubeflow-trainer-trainjob",
    node_script=True,
    image=True,
    source=True,
    engine="Kubeflow Trainer (TrainJob)",
    node_variables=NODE_VARIABLES,
    manifests=(ManifestKind(KIND, "a TrainJob", lambda data: isinstance(data, dict) and data.get("kind") == KIND,
                            "spec.trainer", "kind:", trainjob_fields, trainjob_problem, REFUSED_BY, SECRET_VIA,
                            missing_image=missing_image),),
)
