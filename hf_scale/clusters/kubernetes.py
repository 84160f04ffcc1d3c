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

What `hf-scale check --manifest` reads of either kind, generated or hand-written, is shared here too: the pods'
fields (:func:`manifest_fields`) and what Kubeflow's API models, the API server and the webhooks refuse
(:func:`model_problem`, :func:`object_problem`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import yaml

from hf_scale.clusters.target import NODES, PER_NODE, ManifestFields, env_values, shell_words
from hf_scale.config.cluster_section import CONTAINER_UID, DEFAULT_IMAGE_HOME
from hf_scale.config.distributed_config import DistributedConfig
from hf_scale.errors import UserError
from hf_scale.generators import output_paths
from hf_scale.generators.launch import _check_name

MANAGER = "hf-scale"
"""runtimePatches' manager: who owns the patch (the TrainJob API keys patches by it)."""
OUTPUT_VOLUME = "output"
HF_CACHE = ".cache/huggingface"
"""HF_HOME under cluster.output_dir: one download per volume, kept across restarts."""
REFUSED_BY = "kubectl"
SECRET_VIA = "a Kubernetes Secret (env valueFrom.secretKeyRef)"
"""How a Kubernetes job passes a credential instead of a plain env value (ManifestKind.secret_via)."""
DEFAULT_GRACE_S = 30
"""Kubernetes' terminationGracePeriodSeconds when a pod sets none."""
NODE_VARIABLES = (("PET_NNODES", NODES), ("PET_NPROC_PER_NODE", PER_NODE))
"""The counts both Kubeflow operators set on every pod (torchrun's PET_* settings: ClusterTarget.node_variables)."""


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


def containers_of(pods: list[dict]) -> list[dict]:
    """Every container of the pod specs."""
    return [container for pod in pods for container in pod.get("containers") or []]


def manifest_fields(pods: list[dict], container: dict, *, nodes: Any, procs: Any, procs_at: str,
                    resources: dict) -> ManifestFields:
    """What a Kubernetes job says: ``container`` is what runs the command (its image, command, args, env),
    ``resources`` its GPUs, ``pods`` the pod specs (their PVC mounts and grace periods; Kubernetes' default grace
    where none sets one); a ``bash -c`` command line is read as bash splits it."""
    containers = containers_of(pods)
    env = env_values(container.get("env"))
    args = [str(arg) for arg in [*(container.get("command") or []), *(container.get("args") or [])]]
    if len(args) >= 3 and args[0].rsplit("/", 1)[-1] in ("bash", "sh") and args[1] == "-c":
        args = [*args[:2], *shell_words(args[2]), *args[3:]]  # a shell command line: its words
    gpu_counts = [int(str(v)) for k, v in (resources.get("limits") or resources.get("requests") or {}).items()
                  if "gpu" in k.lower() and str(v).isdigit()]
    claims = {v.get("name") for pod in pods for v in pod.get("volumes") or [] if v.get("persistentVolumeClaim")}
    mounts = [m.get("mountPath") for c in containers for m in c.get("volumeMounts") or []
              if m.get("name") in claims and not m.get("readOnly")]
    graces = [pod.get("terminationGracePeriodSeconds") for pod in pods]
    return ManifestFields(nodes, procs, procs_at, "the container command's", gpu_counts[0] if gpu_counts else None,
                          container.get("image"), args, min((g for g in graces if isinstance(g, int)),
                                                            default=DEFAULT_GRACE_S), mounts, env)


def model_problem(kind: str, data: dict, read_back: Callable[[dict], Any],
                  rule_problem: Callable[[dict], str | None]) -> str | None:
    """What Kubeflow's API model of ``kind`` refuses (``read_back``: the manifest as the model reads and writes it
    back; ``pip install 'hf-scale[k8s]'``): a model drops what it does not know, so a manifest that does not come
    back unchanged has a key the API does not have. Then what the models cannot tell: ``rule_problem``'s."""
    try:
        back = read_back(data)
    except AttributeError:  # a type the SDK's models lack: what they cannot read, the rules still check
        return rule_problem(data)
    except ImportError:
        raise UserError(f"checking a {kind} needs Kubeflow's API models: pip install 'hf-scale[k8s]'") from None
    except (ValueError, TypeError) as error:
        return " ".join(str(error).split())[:300]
    lost = _first_difference(data, back)
    if lost:
        return f"{lost} is not a field of the {kind} API (a misspelled key is dropped silently)"
    return rule_problem(data)


_DNS_1035_LABEL = re.compile(r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?")
_DNS_1123_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")


def object_problem(kind: str, api: str, data: dict) -> str | None:
    """What the API server and the operators' admission webhooks refuse in any object of either kind that Kubeflow's
    Python models cannot tell (they are generated with every field optional and none of the CRDs' patterns or
    minimums), written out from their sources (each kind's module adds its spec's own rules):

    * apiVersion: each CRD serves one version (kubectl: "no matches for kind");
    * metadata.name: an RFC 1035 label of at most 63 characters (the TrainJob CRD's XValidation rule, the
      PyTorchJob webhook's NameIsDNS1035Label): e.g. `Bad_Name` is refused;
    * the namespace is an RFC 1123 label, ports 1-65535, grace periods and backoffLimit >= 0 (the API server's
      validation of pods and Jobs)."""
    if data.get("apiVersion") != api:
        return f"apiVersion {data.get('apiVersion')!r} is not one the {kind} API serves (allowed: {api})"
    metadata = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
    name = metadata.get("name")
    if name is None and not metadata.get("generateName"):
        return "metadata.name is missing (kubectl refuses an object without a name)"
    if name is not None and not (isinstance(name, str) and len(name) <= 63 and _DNS_1035_LABEL.fullmatch(name)):
        return (f"metadata.name {name!r} is not an RFC 1035 label (at most 63 lowercase letters, digits and '-', "
                "starting with a letter, ending with a letter or digit)")
    return _value_problem(data)


def _walk(node: Any, where: str = "") -> Any:
    """(dotted path, key, value) of every mapping entry in the manifest."""
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{where}.{key}".lstrip(".")
            yield path, key, value
            yield from _walk(value, path)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _walk(value, f"{where}[{index}]")


def _value_problem(data: dict) -> str | None:
    """Values the API server refuses anywhere in a Kubernetes object (pod templates included): a namespace that is
    not an RFC 1123 label, a container port outside 1-65535, a negative grace period or backoffLimit."""
    metadata = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
    namespace = metadata.get("namespace")
    if namespace is not None and not (isinstance(namespace, str) and _DNS_1123_LABEL.fullmatch(namespace)):
        return (f"metadata.namespace {namespace!r} is not an RFC 1123 label (at most 63 lowercase letters, digits "
                "and '-', starting and ending with a letter or digit)")
    ranges = {"containerPort": (1, 65535), "terminationGracePeriodSeconds": (0, None),
              "backoffLimit": (0, None), "activeDeadlineSeconds": (1, None)}
    for path, key, value in _walk(data):
        if key not in ranges:
            continue
        low, high = ranges[key]
        if not (isinstance(value, int) and not isinstance(value, bool)) or value < low or (high and value > high):
            allowed = f"{low}-{high}" if high else f"an integer >= {low}"
            return f"{path}={value!r} is not allowed (allowed: {allowed})"
    return None


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
