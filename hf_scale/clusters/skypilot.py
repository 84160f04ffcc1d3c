"""The ``skypilot`` target: ``launch/NAME.sky.yaml``, a SkyPilot task (``sky launch`` for a cluster, ``sky jobs
launch`` for a managed job that survives spot preemption).

SkyPilot syncs the generated directory (``workdir: .``: launch it from the output directory of `hf-scale
generate`) to every node, ``setup`` installs hf_scale from it (``hf-scale-source.tar.gz``, the hf_scale that
generated the files, with its pinned dependencies: hf_scale.generators.install; never from a package index),
and ``run`` starts ``launch/NAME.node.sh`` on each of
``num_nodes`` nodes, which reads SKYPILOT_NODE_RANK / SKYPILOT_NODE_IPS / SKYPILOT_NUM_NODES /
SKYPILOT_NUM_GPUS_PER_NODE (hf_scale.generators.node_entry). Checkpoints go to a bucket mounted at
``cluster.output_dir``: a managed job recovered on new nodes (preemption, or exit 75 after a stop request, listed
in ``recover_on_exit_codes``) resumes from the newest complete checkpoint there.

The stop budget (a step plus a save, cluster.termination_grace_period_s: predicted by `hf-scale plan`) goes where
SkyPilot has a setting for it: on Kubernetes infra the pods' ``terminationGracePeriodSeconds``
(``config.kubernetes.pod_config``, a task-level override of SkyPilot's config). A cloud VM's preemption notice is
the cloud's (AWS spot: 2 minutes; GCP and Azure spot: 30 s), which no SkyPilot field lengthens: there a save that
does not fit is lost and the recovered job resumes from the checkpoint before it (the header says so).

`hf-scale check --manifest` reads a task's fields with :func:`task_fields` and validates it with
:func:`skypilot_problem`: SkyPilot's own JSON schemas (``sky.utils.schemas``: the task, its resources, its storage
mounts, dumped from skypilot SKYPILOT_SCHEMA_VERSION into hf_scale/assets/skypilot_schemas.json), applied as
``sky.Task.from_yaml`` applies them (its validator: Draft 7 plus SkyPilot's two enum keywords; envs and secrets read
as strings; top-level nulls dropped) with jsonschema (``pip install 'hf-scale[sky]'``). SkyPilot itself cannot be
installed beside hf_scale (skypilot pins click<8.2, huggingface-hub needs click>=8.4.2), so its schemas travel with
hf_scale; the tests check the copy against a real skypilot whenever one is at hand.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import shlex
from importlib import resources
from typing import Any

import yaml

from hf_scale.clusters.kubernetes import job_name
from hf_scale.clusters.target import (
    NODES,
    PER_NODE,
    ClusterTarget,
    ManifestFields,
    ManifestKind,
    env_values,
    shell_words,
)
from hf_scale.config.distributed_config import DistributedConfig
from hf_scale.errors import UserError
from hf_scale.exit_codes import EXIT_PREEMPTED
from hf_scale.generators import output_paths
from hf_scale.generators.install import REQUIREMENTS_FILE, SOURCE_ARCHIVE, pip_install
from hf_scale.generators.launch import _check_name

NAME = "skypilot"
KIND = "SkyPilot"
SKYPILOT_SCHEMAS = "skypilot_schemas.json"
"""In hf_scale/assets: {"skypilot_version", "task", "resources", "storage"}."""
SKYPILOT_SCHEMA_VERSION = "0.14.1"


def sky_task(cfg: DistributedConfig, name: str) -> dict[str, Any]:
    """The task as a dict (SkyPilot's own schemas accept it: :func:`skypilot_problem`)."""
    _check_name(name)
    cluster, sky = cfg.cluster, cfg.cluster.skypilot
    grace = cluster.termination_grace_period_s
    run = shlex.join(["bash", output_paths.launch_file(f"{name}.node.sh"), *cluster.node_train_args(name)])
    return {
        "name": job_name(name),
        "num_nodes": cfg.topology.num_machines,
        "resources": {
            "accelerators": f"{sky.accelerator}:{cfg.topology.processes_per_machine}",
            "use_spot": sky.use_spot,
            "job_recovery": {
                "strategy": "FAILOVER",
                "max_restarts_on_errors": cluster.max_restarts,
                "recover_on_exit_codes": [EXIT_PREEMPTED],
            },
        },
        "workdir": ".",
        "file_mounts": {cluster.output_dir: {"name": sky.bucket, "mode": "MOUNT"}},
        **({"envs": dict(cluster.env)} if cluster.env else {}),
        "setup": pip_install(),
        "run": run,
        "config": {"kubernetes": {"pod_config": {"spec": {"terminationGracePeriodSeconds": grace}}}},
    }


def sky_yaml(cfg: DistributedConfig, name: str, *, header: str) -> str:
    grace = cfg.cluster.termination_grace_period_s
    usage = f"""Launch from the directory holding launch/ (workdir: . is synced to every node):
  sky jobs launch launch/{name}.sky.yaml        (managed: recovers from preemption, resumes from the bucket)
  sky launch -c {job_name(name)} launch/{name}.sky.yaml   (a cluster you manage)
setup installs hf_scale from the synced {SOURCE_ARCHIVE} with {REQUIREMENTS_FILE} (written beside
launch/ by hf-scale generate: the hf_scale that generated these files).
A stop (preemption, `sky jobs cancel`) must finish the step in progress and write a checkpoint: {grace} s
(cluster.termination_grace_period_s, a step plus a save predicted by `hf-scale plan`). On Kubernetes infra,
config.kubernetes.pod_config gives the pods that grace period; a cloud VM's preemption notice is the cloud's (AWS
spot: 2 minutes; GCP and Azure spot: 30 s) and SkyPilot has no field to lengthen it: a save longer than that is
lost and the recovered job resumes from the checkpoint before it."""
    comment = "".join(f"# {line}".rstrip() + "\n" for line in f"{header}\n{usage}".splitlines())
    return comment + yaml.safe_dump(sky_task(cfg, name), sort_keys=False, default_flow_style=False)


def files(cfg: DistributedConfig, name: str, *, header: str) -> dict[str, str]:
    """``launch/NAME.sky.yaml``."""
    return {output_paths.launch_file(f"{name}.sky.yaml"): sky_yaml(cfg, name, header=header)}


def is_task(data: Any) -> bool:
    """A SkyPilot task: `run` and/or `num_nodes` (a task's own fields), no Kubernetes `kind`."""
    return isinstance(data, dict) and "kind" not in data and ("run" in data or "num_nodes" in data)


def _gpu_count(accelerators: Any) -> int | None:
    """SkyPilot's accelerators: "H100:8", "H100" (one), {H100: 8}, or a list/set of alternatives (the first)."""
    if isinstance(accelerators, dict):
        accelerators = next(iter(accelerators.items()), None)
        return int(accelerators[1]) if accelerators and str(accelerators[1]).isdigit() else (
            1 if accelerators else None)
    if isinstance(accelerators, list) and accelerators:
        return _gpu_count(accelerators[0])
    if isinstance(accelerators, str) and accelerators:
        name, _, count = accelerators.partition(":")
        return int(count) if count.isdigit() else (1 if name and not count else None)
    return None


def task_fields(data: dict) -> ManifestFields:
    """What a task says: num_nodes (1 when left out), the accelerator count, its buckets in MOUNT (or MOUNT_CACHED)
    mode, envs, workdir and its ``run`` as bash reads it. Processes per node are what its launcher is given (a task
    has no field for them); no image (a VM's, or SkyPilot's image_id: nothing to pin) and no grace period field (a
    cloud's preemption notice is the cloud's)."""
    resources_config = data.get("resources") or {}
    resources_config = resources_config if isinstance(resources_config, dict) else {}
    mounts = [path for path, mount in (data.get("file_mounts") or {}).items()
              if isinstance(mount, dict) and str(mount.get("mode", "MOUNT")).upper() in ("MOUNT", "MOUNT_CACHED")]
    env = env_values(data.get("envs"))
    args = shell_words(str(data.get("run") or ""))
    workdir = data.get("workdir") if isinstance(data.get("workdir"), str) else None
    return ManifestFields(data.get("num_nodes", 1), None, None, "the run command's",
                          _gpu_count(resources_config.get("accelerators", resources_config.get("gpus"))), None, args,
                          None, mounts, env, workdir)


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


TARGET = ClusterTarget(
    name=NAME,
    writes="DIR/launch/NAME.sky.yaml",
    summary="SkyPilot task (sky jobs launch)",
    files=files,
    doc_anchor="skypilot",
    node_script=True,
    source=True,
    engine="SkyPilot",
    node_variables=(("SKYPILOT_NUM_NODES", NODES), ("SKYPILOT_NUM_GPUS_PER_NODE", PER_NODE)),
    manifests=(ManifestKind(KIND, "a SkyPilot task", is_task, "resources", "run:, num_nodes:", task_fields,
                            skypilot_problem, "sky launch", "SkyPilot's `secrets:` (sky launch --secret {name})"),),
)
