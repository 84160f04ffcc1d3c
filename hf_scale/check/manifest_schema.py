"""`manifest-invalid`: a job manifest read by the platform's own definitions, not by hand-written rules.

* TrainJob / PyTorchJob: Kubeflow's API models (kubeflow_trainer_api's TrainJob, the Training Operator SDK's
  PyTorchJob; ``pip install 'hf-scale[k8s]'``). A model drops what it does not know, so a manifest that does not
  come back unchanged has a key the API does not have. What the models cannot tell (the API version, the object's
  name, required specs, replica counts: the CRDs' and webhooks' rules) is :func:`_kubeflow_rule_problem`'s.
* SkyPilot task: SkyPilot's own JSON schemas (``sky.utils.schemas``: the task, its resources, its storage mounts,
  dumped from skypilot SKYPILOT_SCHEMA_VERSION into hf_scale/assets/skypilot_schemas.json), applied as
  ``sky.Task.from_yaml`` applies them (its validator: Draft 7 plus SkyPilot's two enum keywords; envs and secrets
  read as strings; top-level nulls dropped) with jsonschema (``pip install 'hf-scale[sky]'``). SkyPilot itself
  cannot be installed beside hf_scale (skypilot pins click<8.2, huggingface-hub needs click>=8.4.2), so its schemas
  travel with hf_scale; the tests check the copy against a real skypilot whenever one is at hand.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import re
from importlib import resources
from typing import Any

from hf_scale.clusters import kubeflow, pytorchjob, skypilot
from hf_scale.errors import UserError

SKYPILOT_SCHEMAS = "skypilot_schemas.json"
"""In hf_scale/assets: {"skypilot_version", "task", "resources", "storage"}."""
SKYPILOT_SCHEMA_VERSION = "0.14.1"


def manifest_problem(kind: str, data: dict) -> str | None:
    """What the platform's own definitions refuse in the manifest; None when they accept it."""
    if kind == skypilot.KIND:
        return skypilot_problem(data)
    return _kubeflow_problem(kind, data)


_DNS_1035_LABEL = re.compile(r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?")


def _kubeflow_rule_problem(kind: str, data: dict) -> str | None:
    """What the API server and the operators' admission webhooks refuse that Kubeflow's Python models cannot tell
    (they are generated with every field optional and none of the CRDs' patterns or minimums), written out from
    their sources:

    * apiVersion: each CRD serves one version (kubectl: "no matches for kind");
    * metadata.name: an RFC 1035 label of at most 63 characters (the TrainJob CRD's XValidation rule, the
      PyTorchJob webhook's NameIsDNS1035Label): e.g. `Bad_Name` is refused;
    * TrainJob: spec.runtimeRef is required (TrainJobSpec), so a TrainJob without a spec runs nothing;
    * PyTorchJob: spec.pytorchReplicaSpecs is required, the Master's replicas must be 1 and a Worker's at least 1
      (the webhook's validatePyTorchReplicaSpecs), restartPolicy is one of its enum, nprocPerNode what torchrun
      takes;
    * any object: the namespace is an RFC 1123 label, ports 1-65535, grace periods and backoffLimit >= 0 (the API
      server's validation of pods and Jobs)."""
    api = {kubeflow.KIND: kubeflow.TRAINJOB_API, pytorchjob.KIND: pytorchjob.PYTORCHJOB_API}[kind]
    if data.get("apiVersion") != api:
        return f"apiVersion {data.get('apiVersion')!r} is not one the {kind} API serves (allowed: {api})"
    metadata = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
    name = metadata.get("name")
    if name is None and not metadata.get("generateName"):
        return "metadata.name is missing (kubectl refuses an object without a name)"
    if name is not None and not (isinstance(name, str) and len(name) <= 63 and _DNS_1035_LABEL.fullmatch(name)):
        return (f"metadata.name {name!r} is not an RFC 1035 label (at most 63 lowercase letters, digits and '-', "
                "starting with a letter, ending with a letter or digit)")
    problem = _kubernetes_value_problem(data)
    if problem:
        return problem
    spec = data.get("spec")
    if kind == kubeflow.KIND:
        if not isinstance(spec, dict) or not spec.get("runtimeRef"):
            return "spec.runtimeRef is missing: the TrainJob names no training runtime (a spec with runtimeRef.name)"
        return None
    replicas = spec.get("pytorchReplicaSpecs") if isinstance(spec, dict) else None
    if not isinstance(replicas, dict) or not replicas:
        return "spec.pytorchReplicaSpecs is missing: the PyTorchJob starts no pod (a Master, and Workers)"
    for role, replica in replicas.items():
        count = replica.get("replicas") if isinstance(replica, dict) else None
        if role == "Master" and count not in (None, 1):
            return f"spec.pytorchReplicaSpecs.Master.replicas={count!r}: the Master must be exactly 1"
        if role != "Master" and count is not None and not (isinstance(count, int) and count >= 1):
            return f"spec.pytorchReplicaSpecs.{role}.replicas={count!r}: must be at least 1 (leave {role} out for none)"
    return _pytorchjob_value_problem(spec)


def _kubeflow_problem(kind: str, data: dict) -> str | None:
    try:
        if kind == kubeflow.KIND:
            from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

            back = TrainerV1alpha1TrainJob.from_dict(data).to_dict()
        else:
            from kubeflow.training.api_client import ApiClient

            client = ApiClient()
            # The SDK's OpenAPI marks runPolicy required (Go's inline struct); the CRD defaults it, and most
            # hand-written jobs leave it out: read it as the operator would.
            spec = data.get("spec")
            if isinstance(spec, dict) and "runPolicy" not in spec:
                data = {**data, "spec": {**spec, "runPolicy": {}}}
            data = _without_metrics(data)
            back = client.sanitize_for_serialization(client._ApiClient__deserialize(data, "KubeflowOrgV1PyTorchJob"))
    except AttributeError:  # a type the SDK's models lack: what they cannot read, the rules below still check
        return _kubeflow_rule_problem(kind, data)
    except ImportError:
        raise UserError(f"checking a {kind} needs Kubeflow's API models: pip install 'hf-scale[k8s]'") from None
    except (ValueError, TypeError) as error:
        return " ".join(str(error).split())[:300]
    lost = _first_difference(data, back)
    if lost:
        return f"{lost} is not a field of the {kind} API (a misspelled key is dropped silently)"
    return _kubeflow_rule_problem(kind, data)


def _without_metrics(data: dict) -> dict:
    """The PyTorchJob without spec.elasticPolicy.metrics: Kubernetes' autoscaling/v2 MetricSpec list, for which the
    Training Operator SDK names a model it does not ship (an AttributeError, not a finding about the job)."""
    spec = data.get("spec")
    policy = spec.get("elasticPolicy") if isinstance(spec, dict) else None
    if not isinstance(policy, dict) or "metrics" not in policy:
        return data
    return {**data, "spec": {**spec, "elasticPolicy": {k: v for k, v in policy.items() if k != "metrics"}}}


_DNS_1123_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")
RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
"""The Training Operator's RestartPolicy enum (its CRD refuses another)."""
NPROC_WORDS = ("auto", "cpu", "gpu")
"""nprocPerNode besides a positive integer: what torchrun's --nproc_per_node takes (the operator passes it on)."""


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


def _kubernetes_value_problem(data: dict) -> str | None:
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


def _pytorchjob_value_problem(spec: dict) -> str | None:
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


@functools.cache
def skypilot_schemas() -> dict[str, Any]:
    return json.loads(resources.files("hf_scale").joinpath("assets", SKYPILOT_SCHEMAS).read_text())


@functools.cache
def _validator_class() -> Any:
    """sky.utils.validator.get_schema_validator: Draft 7 with SkyPilot's case-(in)sensitive enum keywords."""
    try:
        import jsonschema
    except ImportError:
        raise UserError("checking a SkyPilot task needs jsonschema: pip install 'hf-scale[sky]'") from None

    def enum(case_sensitive: bool):
        def check(validator, enums, instance, schema):
            fold = (lambda value: value) if case_sensitive else (lambda value: str(value).lower())
            if fold(instance) not in [fold(value) for value in enums]:
                yield jsonschema.ValidationError(f"{instance!r} is not one of {enums!r}")

        return check

    return jsonschema.validators.extend(
        jsonschema.Draft7Validator,
        validators={"case_insensitive_enum": enum(False), "case_sensitive_enum": enum(True)},
    )


def _schema_error(instance: dict, schema: dict, where: str) -> str | None:
    """The first error of ``instance`` against ``schema``, worded for a person: an unknown key names the closest
    known one (SkyPilot's own message does too)."""
    instance = {key: value for key, value in instance.items() if value is not None}  # as SkyPilot: skip_none
    error = next(iter(sorted(_validator_class()(schema).iter_errors(instance), key=lambda e: list(e.path))), None)
    if error is None:
        return None
    path = ".".join([where, *map(str, error.absolute_path)]).strip(".") or "the task"
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = sorted((error.schema or {}).get("properties") or {})
        unknown = [key for key in error.instance if key not in known]
        if unknown and known:
            close = difflib.get_close_matches(str(unknown[0]), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(known)})"
            return f"{path}: {unknown[0]!r} is not a SkyPilot field{hint}"
    return f"{path}: {' '.join(error.message.split())[:240]}"


def skypilot_problem(task: dict) -> str | None:
    """The task as ``sky.Task.from_yaml`` validates it: the task schema, its resources, every storage mount."""
    schemas = skypilot_schemas()
    task = copy.deepcopy(task)
    for key in ("envs", "secrets"):  # SkyPilot reads these as strings before validating (`A: 1` is "1")
        if isinstance(task.get(key), dict):
            task[key] = {str(k): None if v is None else str(v) for k, v in task[key].items()}
    problem = _schema_error(task, schemas["task"], "")
    if problem:
        return problem
    resources_config = task.get("resources")
    if isinstance(resources_config, dict):
        if "gpus" in resources_config and "accelerators" not in resources_config:  # SkyPilot's alias
            resources_config["accelerators"] = resources_config.pop("gpus")
        problem = _accelerator_count_problem(resources_config.get("accelerators"))
        if problem:
            return problem
        resources_config.pop("hooks", None)  # task-scoped, routed around the resources schema by SkyPilot
        problem = _schema_error(resources_config, schemas["resources"], "resources")
        if problem:
            return problem
    for target, mount in (task.get("file_mounts") or {}).items():
        if isinstance(mount, dict):
            problem = _schema_error(mount, schemas["storage"], f"file_mounts.{target}")
            if problem:
                return problem
    return None


def _accelerator_count_problem(accelerators: Any) -> str | None:
    """SkyPilot reads an accelerator count (`H100:8`, {H100: 8}) as a float and then as a number of GPUs: one that is
    not a finite positive number (`H100:1e400` is infinite) crashes or is refused by sky launch."""
    import math

    if isinstance(accelerators, str):
        counts = [accelerators.partition(":")[2]] if ":" in accelerators else []
    elif isinstance(accelerators, dict):
        counts = [count for count in accelerators.values() if count is not None]
    else:
        return None
    for count in counts:
        try:
            number = float(count)
        except (TypeError, ValueError):
            number = math.nan
        if not (math.isfinite(number) and number > 0):
            return (f"resources.accelerators: count {count!r} of {accelerators!r} is not a finite positive number "
                    "(write e.g. H100:8)")
    return None
