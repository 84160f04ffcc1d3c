"""`hf-scale check --manifest FILE`: a TrainJob, PyTorchJob or SkyPilot task (generated or hand-written, recognized
by its content) against the accelerate YAML it runs, and against what a restartable job needs.

`manifest-invalid`: the Kubernetes kinds are read with Kubeflow's own API models (kubeflow_trainer_api's TrainJob,
the Training Operator SDK's PyTorchJob); a key they drop or a type they refuse is an error. `manifest-nodes`,
`manifest-processes`: node count vs the YAML's num_machines, processes per node (numProcPerNode / nprocPerNode)
vs num_processes / num_machines. `manifest-gpus`: GPUs per node (the GPU resource, the SkyPilot accelerator
count) vs processes per node. `manifest-image`: the image has a version tag or digest (not `latest`, not none).
`manifest-output-volume`: --output_dir is on a writable persistent volume (a PVC, a bucket in MOUNT mode), so a
restarted node finds the checkpoints. `manifest-grace-period` (Kubernetes): terminationGracePeriodSeconds vs
saving one checkpoint: measured from ``--checkpoint DIR`` (from its oldest file to its manifest, written last),
else at least GRACE_FLOOR_S (the documented estimate: the rest of a step plus one save of a multi-GB state).
`manifest-deepspeed-batch`: a DeepSpeed JSON's concrete `train_batch_size` against the world size the manifest
starts (nodes x processes per node): DeepSpeed asserts train_batch_size = micro batch x accumulation x world size
at start, on the cluster, after the job has queued.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hf_scale.check.batch import deepspeed_accepts_batch
from hf_scale.check.findings import ERROR, WARNING, Finding
from hf_scale.cluster_config import image_problem
from hf_scale.errors import UserError

GRACE_FLOOR_S = 120
"""Without a measured save: the least grace period we call safe (Kubernetes' default, 30 s, is not)."""
KUBERNETES_DEFAULT_GRACE_S = 30
GRACE_MARGIN = 2.0
"""The grace period must cover the measured save this many times (the step in progress, a slower filesystem)."""


def manifest_kind(data: Any) -> str:
    """TrainJob, PyTorchJob or SkyPilot (a task: `run` and/or `num_nodes`/`resources`, no `kind`)."""
    if isinstance(data, dict) and data.get("kind") in ("TrainJob", "PyTorchJob"):
        return data["kind"]
    if isinstance(data, dict) and "kind" not in data and ("run" in data or "num_nodes" in data):
        return "SkyPilot"
    raise UserError("the manifest is neither a TrainJob, a PyTorchJob (kind:) nor a SkyPilot task (run:, num_nodes:)")


def _model_problem(kind: str, data: dict) -> str | None:
    """What Kubeflow's API models refuse or drop; None when they read the manifest back unchanged."""
    try:
        if kind == "TrainJob":
            from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

            back = TrainerV1alpha1TrainJob.from_dict(data).to_dict()
        elif kind == "PyTorchJob":
            from kubeflow.training.api_client import ApiClient

            client = ApiClient()
            # The SDK's OpenAPI marks runPolicy required (Go's inline struct); the CRD defaults it, and most
            # hand-written jobs leave it out: read it as the operator would.
            spec = data.get("spec")
            if isinstance(spec, dict) and "runPolicy" not in spec:
                data = {**data, "spec": {**spec, "runPolicy": {}}}
            back = client.sanitize_for_serialization(client._ApiClient__deserialize(data, "KubeflowOrgV1PyTorchJob"))
        else:
            return None
    except ImportError:
        raise UserError(f"checking a {kind} needs Kubeflow's API models: pip install 'hf-scale[k8s]'") from None
    except (ValueError, TypeError) as error:
        return " ".join(str(error).split())[:300]
    lost = _first_difference(data, back)
    return f"{lost} is not a field of the {kind} API (a misspelled key is dropped silently)" if lost else None


def _first_difference(want: Any, got: Any, where: str = "") -> str | None:
    if isinstance(want, dict) and isinstance(got, dict):
        for key, value in want.items():
            if key not in got:
                return f"{where}.{key}".lstrip(".")
            found = _first_difference(value, got[key], f"{where}.{key}")
            if found:
                return found
    elif isinstance(want, list) and isinstance(got, list):
        for index, (a, b) in enumerate(zip(want, got, strict=False)):
            found = _first_difference(a, b, f"{where}[{index}]")
            if found:
                return found
    return None


def _pods(kind: str, data: dict) -> list[dict]:
    spec = data.get("spec") or {}
    if kind == "PyTorchJob":
        return [(replica.get("template") or {}).get("spec") or {} for replica in
                (spec.get("pytorchReplicaSpecs") or {}).values()]
    pods = []
    for patch in spec.get("runtimePatches") or []:
        jobset = ((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}
        for job in jobset.get("replicatedJobs") or []:
            pod = (((job.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec")
            if pod:
                pods.append(pod)
    return pods


def _facts(kind: str, data: dict) -> dict[str, Any]:
    """Nodes, processes and GPUs per node, image, container args, the grace period, writable persistent mounts."""
    spec = data.get("spec") or {}
    if kind == "SkyPilot":
        resources = data.get("resources") or {}
        accelerators = str(resources.get("accelerators") or "")
        gpus = int(accelerators.rpartition(":")[2]) if accelerators.rpartition(":")[2].isdigit() else (
            1 if accelerators else None)
        mounts = [path for path, mount in (data.get("file_mounts") or {}).items()
                  if isinstance(mount, dict) and str(mount.get("mode", "MOUNT")).upper() in ("MOUNT", "MOUNT_CACHED")]
        return {"nodes": data.get("num_nodes", 1), "procs": None, "gpus": gpus, "image": None,
                "args": shlex.split(str(data.get("run") or ""), comments=True), "grace": None, "mounts": mounts}
    pods = _pods(kind, data)
    if kind == "TrainJob":
        trainer = spec.get("trainer") or {}
        container = trainer
        nodes, procs = trainer.get("numNodes"), trainer.get("numProcPerNode")
        resources = trainer.get("resourcesPerNode") or {}
        containers = [c for pod in pods for c in pod.get("containers") or []]
    else:
        replicas = spec.get("pytorchReplicaSpecs") or {}
        nodes = sum(int(replica.get("replicas", 1)) for replica in replicas.values())
        procs = spec.get("nprocPerNode")
        containers = [c for pod in pods for c in pod.get("containers") or []]
        container = containers[0] if containers else {}
        resources = container.get("resources") or {}
    gpu_counts = [int(str(v)) for k, v in (resources.get("limits") or resources.get("requests") or {}).items()
                  if "gpu" in k.lower() and str(v).isdigit()]
    claims = {v.get("name") for pod in pods for v in pod.get("volumes") or [] if v.get("persistentVolumeClaim")}
    mounts = [m.get("mountPath") for c in containers for m in c.get("volumeMounts") or []
              if m.get("name") in claims and not m.get("readOnly")]
    graces = [pod.get("terminationGracePeriodSeconds") for pod in pods]
    return {"nodes": nodes, "procs": int(procs) if str(procs).isdigit() else None,
            "gpus": gpu_counts[0] if gpu_counts else None, "image": container.get("image"),
            "args": [*(container.get("command") or []), *(container.get("args") or [])],
            "grace": min((g for g in graces if isinstance(g, int)), default=KUBERNETES_DEFAULT_GRACE_S),
            "mounts": mounts}


def _count(value: Any) -> int | None:
    """A count as `accelerate launch` reads it (int()), None when it is none (`auto`, a word: other findings)."""
    try:
        return int(value) if not isinstance(value, bool) and value is not None else None
    except (TypeError, ValueError):
        return None


def _deepspeed_batch(path: str, kind: str, facts: dict[str, Any], deepspeed: dict) -> Iterator[Finding]:
    """DeepSpeed's start-up assertion, train_batch_size == micro x accumulation x world size, with the world size
    this manifest starts; "auto" values are resolved by the Trainer from the real world size (nothing to compare)."""
    per_node = facts["procs"] or facts["gpus"]
    nodes = _count(facts["nodes"])
    batch = _count(deepspeed.get("train_batch_size"))
    if not (per_node and nodes and batch):
        return
    world = nodes * per_node
    micro = _count(deepspeed.get("train_micro_batch_size_per_gpu"))
    accumulation = _count(deepspeed.get("gradient_accumulation_steps", 1))
    if micro and accumulation and not deepspeed_accepts_batch(batch, micro, accumulation, world)[0]:
        problem = (f"train_batch_size={batch} but micro batch {micro} x accumulation {accumulation} x "
                   f"{world} processes ({nodes} node(s) x {per_node}) = {micro * accumulation * world}")
    elif batch % world:
        problem = f"train_batch_size={batch} does not divide over {world} processes ({nodes} node(s) x {per_node})"
    else:
        return
    yield Finding(ERROR, "manifest-deepspeed-batch", path, "train_batch_size",
                  f"{kind} starts {world} processes and the DeepSpeed config says {problem}: DeepSpeed stops at start",
                  'set train_batch_size (and the micro batch / accumulation) to "auto", or to values whose product '
                  "is this world size's", {f"{path}:world_size": world, "deepspeed:train_batch_size": batch})


def measured_save_seconds(checkpoint_dir: Path) -> float:
    """How long saving `checkpoint_dir` took: from its oldest file to its manifest (written last, hf_scale's)."""
    from hf_scale.train.checkpoint.layout import MANIFEST

    files = [f for f in checkpoint_dir.rglob("*") if f.is_file()]
    manifest = checkpoint_dir / MANIFEST
    if not manifest.is_file() or not files:
        raise UserError(f"--checkpoint {checkpoint_dir}: not a complete hf_scale checkpoint (no {MANIFEST})")
    return max(0.0, manifest.stat().st_mtime - min(f.stat().st_mtime for f in files))


def check_manifest(path: str, data: Any, accelerate: dict | None, *, save_seconds: float | None = None,
                   deepspeed: dict | None = None) -> Iterator[Finding]:
    """`manifest-invalid`, `manifest-nodes`, `manifest-processes`, `manifest-gpus`, `manifest-image`,
    `manifest-output-volume`, `manifest-grace-period`, `manifest-deepspeed-batch`: see the module docstring."""
    kind = manifest_kind(data)
    problem = _model_problem(kind, data)
    if problem:
        yield Finding(ERROR, "manifest-invalid", path, kind, problem, f"fix the {kind} (kubectl would refuse it)")
    facts = _facts(kind, data)
    if deepspeed is not None:
        yield from _deepspeed_batch(path, kind, facts, deepspeed)
    where = {"TrainJob": "spec.trainer", "PyTorchJob": "spec", "SkyPilot": "resources"}[kind]
    if accelerate is not None:
        machines = _count(accelerate.get("num_machines", 1)) or 1
        # `num_processes: auto` (one per GPU, torchrun's choice) or a value the YAML checks report: nothing to compare.
        processes = _count(accelerate.get("num_processes", 1))
        per_machine = processes // machines if processes else None
        if facts["nodes"] != machines:
            yield Finding(ERROR, "manifest-nodes", path, "numNodes/replicas/num_nodes",
                          f"{kind} runs {facts['nodes']} node(s), the accelerate config num_machines={machines}",
                          "make them equal (world size = nodes x processes per node)",
                          {f"{path}:nodes": facts["nodes"], "accelerate:num_machines": machines})
        if None not in (facts["procs"], per_machine) and facts["procs"] != per_machine:
            yield Finding(ERROR, "manifest-processes", path, f"{where} processes per node",
                          f"{kind} starts {facts['procs']} process(es) per node, the accelerate config "
                          f"{per_machine} (num_processes / num_machines)", "make them equal",
                          {f"{path}:processes": facts["procs"], "accelerate:per_machine": per_machine})
        if None not in (facts["gpus"], per_machine) and facts["gpus"] != per_machine and accelerate.get(
                "use_cpu") is not True:
            yield Finding(ERROR, "manifest-gpus", path, f"{where} GPUs",
                          f"{kind} gives each node {facts['gpus']} GPU(s) for {per_machine} process(es)",
                          "one GPU per process: set the GPU count to the processes per machine",
                          {f"{path}:gpus": facts["gpus"], "accelerate:per_machine": per_machine})
    if kind != "SkyPilot":
        image = facts["image"] or ""
        image_issue = image_problem(image) if image else "is missing"
        if image_issue:
            yield Finding(ERROR, "manifest-image", path, "image", f"image {image!r} {image_issue}",
                          "use a pinned image, e.g. registry.example.com/team/hf-scale:0.1.0")
    args = facts["args"]
    output = next((arg.split("=", 1)[1] if "=" in arg else args[i + 1] for i, arg in enumerate(args)
                   if arg.split("=")[0] == "--output_dir" and ("=" in arg or i + 1 < len(args))), None)
    on_volume = output is not None and any(
        mount and (output == mount or output.startswith(mount.rstrip("/") + "/")) for mount in facts["mounts"])
    if not on_volume:
        yield Finding(ERROR, "manifest-output-volume", path, "--output_dir",
                      f"--output_dir {output!r} is not on a writable persistent volume "
                      f"({'mounts: ' + ', '.join(facts['mounts']) if facts['mounts'] else 'none mounted'}): "
                      "a restarted node would start afresh", "mount a PVC (Kubernetes) or a bucket in MOUNT mode "
                      "(SkyPilot) and put --output_dir under it")
    if facts["grace"] is not None:
        need = GRACE_MARGIN * save_seconds if save_seconds is not None else GRACE_FLOOR_S
        if facts["grace"] < need:
            basis = (f"{GRACE_MARGIN:g} x the measured save of {save_seconds:.0f} s" if save_seconds is not None
                     else f"{GRACE_FLOOR_S} s (no --checkpoint to measure a save)")
            yield Finding(ERROR if save_seconds is not None else WARNING, "manifest-grace-period", path,
                          "terminationGracePeriodSeconds",
                          f"a grace period of {facts['grace']} s may end before the checkpoint is saved; needs "
                          f"{basis}", f"set terminationGracePeriodSeconds >= {need:.0f}")
