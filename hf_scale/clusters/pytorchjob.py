"""The ``pytorchjob`` target: ``launch/NAME.pytorchjob.yaml``, the Training Operator's kubeflow.org/v1 PyTorchJob
(hf_scale.clusters.kubernetes has what it shares with the TrainJob).

Restarts: a PyTorchJob restarts a failed container in place (``restartPolicy: OnFailure``: exit 75 after a
checkpoint counts as a failure) up to ``runPolicy.backoffLimit`` times, and recreates pods lost with their node.

`hf-scale check --manifest` reads a PyTorchJob's fields with :func:`pytorchjob_fields` (its replicas, the first
container), validates it with :func:`pytorchjob_problem` (the Training Operator SDK's model, then the CRD's and the
webhook's rules), requires an image (:func:`missing_image`) and a restart policy that restarts exit 75
(:func:`restart_notes`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from hf_scale.clusters.kubernetes import (
    MANAGER,
    NODE_VARIABLES,
    REFUSED_BY,
    SECRET_VIA,
    containers_of,
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


def pytorchjob_fields(data: dict) -> ManifestFields:
    """What a PyTorchJob says: the nodes are its replicas (Master and Workers), nprocPerNode the processes per node,
    its first container runs the command (image, command, args, env, GPU resources)."""
    spec = data.get("spec") or {}
    replicas = [r for r in (spec.get("pytorchReplicaSpecs") or {}).values() if isinstance(r, dict)]
    pods = [(replica.get("template") or {}).get("spec") or {} for replica in replicas]
    containers = containers_of(pods)
    nodes = sum(int(replica.get("replicas", 1)) for replica in replicas)
    container = containers[0] if containers else {}
    return manifest_fields(pods, container, nodes=nodes, procs=spec.get("nprocPerNode"), procs_at="spec.nprocPerNode",
                           resources=container.get("resources") or {})


RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
"""The Training Operator's RestartPolicy enum (its CRD refuses another)."""
FINAL_EXIT_POLICIES = ("Never", "ExitCode")
"""The restart policies under which train.py's preemption exit (75) is final: `Never` restarts nothing, `ExitCode`
restarts only on exit codes 128-255 (1-127 are permanent); `OnFailure` and `Always` restart it."""
NPROC_WORDS = ("auto", "cpu", "gpu")
"""nprocPerNode besides a positive integer: what torchrun's --nproc_per_node takes (the operator passes it on)."""


def _read_back(data: dict) -> dict:
    from kubeflow.training.api_client import ApiClient

    client = ApiClient()
    return client.sanitize_for_serialization(client._ApiClient__deserialize(data, "KubeflowOrgV1PyTorchJob"))


def _as_the_operator_reads(data: dict) -> dict:
    """The SDK's OpenAPI marks runPolicy required (Go's inline struct); the CRD defaults it, and most hand-written
    jobs leave it out: read it as the operator would. Without spec.elasticPolicy.metrics: Kubernetes' autoscaling/v2
    MetricSpec list, for which the Training Operator SDK names a model it does not ship (an AttributeError, not a
    finding about the job)."""
    spec = data.get("spec")
    if isinstance(spec, dict) and "runPolicy" not in spec:
        data = {**data, "spec": {**spec, "runPolicy": {}}}
    spec = data.get("spec")
    policy = spec.get("elasticPolicy") if isinstance(spec, dict) else None
    if not isinstance(policy, dict) or "metrics" not in policy:
        return data
    return {**data, "spec": {**spec, "elasticPolicy": {k: v for k, v in policy.items() if k != "metrics"}}}


def _rule_problem(data: dict) -> str | None:
    """Any Kubeflow object's rules (hf_scale.clusters.kubernetes.object_problem), then the PyTorchJob's own:
    spec.pytorchReplicaSpecs is required, the Master's replicas must be 1 and a Worker's at least 1 (the webhook's
    validatePyTorchReplicaSpecs), restartPolicy is one of its enum, nprocPerNode what torchrun takes."""
    problem = object_problem(KIND, PYTORCHJOB_API, data)
    if problem:
        return problem
    spec = data.get("spec")
    replicas = spec.get("pytorchReplicaSpecs") if isinstance(spec, dict) else None
    if not isinstance(replicas, dict) or not replicas:
        return "spec.pytorchReplicaSpecs is missing: the PyTorchJob starts no pod (a Master, and Workers)"
    for role, replica in replicas.items():
        count = replica.get("replicas") if isinstance(replica, dict) else None
        if role == "Master" and count not in (None, 1):
            return f"spec.pytorchReplicaSpecs.Master.replicas={count!r}: the Master must be exactly 1"
        if role != "Master" and count is not None and not (isinstance(count, int) and count >= 1):
            return f"spec.pytorchReplicaSpecs.{role}.replicas={count!r}: must be at least 1 (leave {role} out for none)"
    return _value_problem(spec)


def _value_problem(spec: dict) -> str | None:
    """nprocPerNode (the operator hands it to torchrun as PET_NPROC_PER_NODE) and each replica's restartPolicy."""
    nproc = spec.get("nprocPerNode")
    if nproc is not None and not (str(nproc) in NPROC_WORDS or (str(nproc).isdigit() and int(str(nproc)) > 0)):
        return (f"spec.nprocPerNode={nproc!r}: torchrun refuses it (allowed: a positive integer, "
                f"{', '.join(NPROC_WORDS)})")
    for role, replica in (spec.get("pytorchReplicaSpecs") or {}).items():
        policy = replica.get("restartPolicy") if isinstance(replica, dict) else None
        if policy is not None and policy not in RESTART_POLICIES:
            return (f"spec.pytorchReplicaSpecs.{role}.restartPolicy={policy!r} is not one the API has (allowed: "
                    f"{', '.join(RESTART_POLICIES)})")
    return None


def pytorchjob_problem(data: dict) -> str | None:
    """What the Training Operator refuses in a PyTorchJob: its SDK's PyTorchJob model (read as the operator reads
    it), then the CRD's and the webhook's rules."""
    return model_problem(KIND, _as_the_operator_reads(data), _read_back, _rule_problem)


def missing_image(data: dict, runs_hf_scale: bool, file: str) -> ManifestNote | None:
    """A PyTorchJob's container must name its image (Kubernetes refuses one without)."""
    return ManifestNote("image", "image '' is missing (Kubernetes refuses a container without one)")


def restart_notes(data: dict, file: str) -> Iterator[ManifestNote]:
    """Each replica whose restartPolicy makes train.py's preemption exit (75: saved, restart me) final
    (:data:`FINAL_EXIT_POLICIES`), so a preempted job is lost instead of resumed."""
    for role, replica in ((data.get("spec") or {}).get("pytorchReplicaSpecs") or {}).items():
        policy = replica.get("restartPolicy") if isinstance(replica, dict) else None
        if policy in FINAL_EXIT_POLICIES:
            yield ManifestNote(f"spec.pytorchReplicaSpecs.{role}.restartPolicy",
                               f"restartPolicy {policy}: train.py exits 75 on preemption (checkpoint saved, restart "
                               "me), which this policy makes final: a preempted job is lost, not resumed",
                               f"set restartPolicy: OnFailure for {role} in {file}")


TARGET = ClusterTarget(
    name=NAME,
    writes="DIR/launch/NAME.pytorchjob.yaml",
    summary="Training Operator PyTorchJob (kubectl apply -f)",
    files=files,
    doc_anchor="training-operator-pytorchjob",
    node_script=True,
    image=True,
    source=True,
    engine="Training Operator (PyTorchJob)",
    node_variables=NODE_VARIABLES,
    manifests=(ManifestKind(KIND, "a PyTorchJob", lambda data: isinstance(data, dict) and data.get("kind") == KIND,
                            "spec", "kind:", pytorchjob_fields, pytorchjob_problem, REFUSED_BY, SECRET_VIA,
                            missing_image=missing_image, restart_notes=restart_notes),),
)
