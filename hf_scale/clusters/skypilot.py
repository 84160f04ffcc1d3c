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
"""

from __future__ import annotations

import shlex
from typing import Any

import yaml

from hf_scale.clusters.kubernetes import job_name
from hf_scale.clusters.target import ClusterTarget, ManifestKind
from hf_scale.config.distributed_config import DistributedConfig
from hf_scale.exit_codes import EXIT_PREEMPTED
from hf_scale.generators import output_paths
from hf_scale.generators.install import REQUIREMENTS_FILE, SOURCE_ARCHIVE, pip_install
from hf_scale.generators.launch import _check_name

NAME = "skypilot"
KIND = "SkyPilot"


def sky_task(cfg: DistributedConfig, name: str) -> dict[str, Any]:
    """The task as a dict (SkyPilot's own schemas accept it: hf_scale.check.manifest_schema)."""
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


TARGET = ClusterTarget(
    name=NAME,
    writes="DIR/launch/NAME.sky.yaml",
    summary="SkyPilot task (sky jobs launch)",
    files=files,
    doc_anchor="skypilot",
    node_script=True,
    source=True,
    manifests=(ManifestKind(KIND, "a SkyPilot task", is_task, "resources", "run:, num_nodes:"),),
)
