"""What a cluster target is: the record each module of hf_scale.clusters declares (its ``TARGET``), which the
registry (hf_scale.clusters.TARGETS) lists and `hf-scale generate`, `hf-scale check --manifest` and the docs read;
and what a target tells check about its job manifests (:class:`ManifestKind`): how its fields read
(:class:`ManifestFields`), what its platform refuses, how its messages word that platform's ways. hf_scale.check
reaches a kind only through this record, so a target with a new kind of manifest changes nothing in check."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hf_scale.config.distributed_config import DistributedConfig

NODES, PER_NODE = "nodes", "processes per node"
"""What a count counts: a platform's variable (:attr:`ClusterTarget.node_variables`), a launcher's flag."""
FileWriter = Callable[..., dict[str, str]]
"""``writer(cfg, name, *, header=...)`` -> relative path (under generate's output directory) -> file text."""


@dataclass(frozen=True)
class ManifestFields:
    """What a job manifest's own fields say about the run it starts (its kind's :attr:`ManifestKind.fields` reads
    them; hf_scale.check.manifest_facts adds what the launcher in its command is given)."""

    nodes: Any
    """The node count as written (numNodes, the replicas, num_nodes)."""
    procs: Any
    """Processes per node as the manifest's own field writes it (numProcPerNode, nprocPerNode); None without one."""
    procs_at: str | None
    """Where that field is (``spec.nprocPerNode``); None when the manifest has none: the command's launcher decides."""
    command: str
    """How a message names its command, before the launcher: "the container command's", "the run command's"."""
    gpus: int | None
    """GPUs per node (the GPU resource, the accelerator count); None when not stated."""
    image: str | None
    """The image its command runs in; None when not written (or the platform has none to check)."""
    args: list[str]
    """The words of the command its nodes run (a shell command line split as bash splits it: :func:`shell_words`)."""
    grace: int | None
    """The seconds a stopped node has to save (terminationGracePeriodSeconds); None where no field sets it."""
    mounts: list[str]
    """Where writable persistent storage is mounted (a PVC, a bucket in MOUNT mode)."""
    env: dict[str, str] = field(default_factory=dict)
    """The environment of the command, name -> value as written."""
    workdir: str | None = None
    """The directory the command runs in, relative to the manifest (SkyPilot's synced ``workdir``)."""


@dataclass(frozen=True)
class ManifestNote:
    """A problem one kind's own rule finds in a manifest, worded for the finding hf_scale.check.cluster makes of it
    (under the code the rule is documented with)."""

    key: str
    problem: str
    fix: str | None = None
    """None: the fix check gives every finding of that code."""
    warning: bool = False
    """A warning (it may be intended), not an error."""


def _no_notes(data: dict, file: str) -> Iterator[ManifestNote]:
    return iter(())


def _image_not_needed(data: dict, runs_hf_scale: bool, file: str) -> ManifestNote | None:
    return None


@dataclass(frozen=True)
class ManifestKind:
    """A job manifest of a target that `hf-scale check --manifest` reads (hf_scale.check.cluster), with what check
    needs to know of it: check names no kind, it asks this record."""

    kind: str
    """The name check gives it in its findings and messages (a Kubernetes ``kind:``, or SkyPilot's task)."""
    article: str
    """How a message names one: "a TrainJob"."""
    recognises: Callable[[Any], bool]
    """True when a parsed YAML document is a manifest of this kind."""
    gpus_at: str
    """Where the manifest states its GPUs per node (the field a manifest-gpus finding names)."""
    how_recognised: str
    """What recognises it, for the one-line refusal of a document that is none (``kind:``, ``run:, num_nodes:``)."""
    fields: Callable[[dict], ManifestFields]
    """What a manifest of this kind says (manifest-nodes, -processes, -gpus, -image, -output-volume, -grace-period,
    -secret, -train-args read it); it may raise AttributeError, TypeError or ValueError on a structure it cannot
    read (a mapping where a list belongs)."""
    problem: Callable[[dict], str | None]
    """What the platform's own definitions (its API models, its schemas) refuse in a manifest, in one line; None when
    they accept it (manifest-invalid)."""
    refused_by: str
    """The tool that would refuse an invalid one, for manifest-invalid's fix: "kubectl"."""
    secret_via: str
    """How the platform passes a secret instead of a plain env value (manifest-secret's fix); ``{name}`` is the
    variable: "a Kubernetes Secret (env valueFrom.secretKeyRef)"."""
    missing_image: Callable[[dict, bool, str], ManifestNote | None] = _image_not_needed
    """What a manifest of this kind without an image means (manifest-image), given the manifest, whether its command
    runs hf_scale and its file name; None when nothing (the platform has no image to check)."""
    restart_notes: Callable[[dict, str], Iterator[ManifestNote]] = _no_notes
    """Where the manifest's restart settings make train.py's preemption exit (75: saved, restart me) final
    (manifest-restart-policy), given the manifest and its file name."""


def shell_words(command: str) -> list[str]:
    """A shell command's words as bash reads them: continuations joined, comments dropped (SkyPilot's ``run``, a
    container's ``bash -c`` line)."""
    text = command.replace("\\\n", " ")
    try:
        return shlex.split(text, comments=True)
    except ValueError:  # unbalanced quotes: bash would refuse it too; read what can be read
        return text.split()


@dataclass(frozen=True)
class ClusterTarget:
    """One cluster target: the files `hf-scale generate` writes for it, and the manifests check reads for it."""

    name: str
    """Its `--targets` name (the module's name: hf_scale/clusters/NAME.py)."""
    writes: str
    """The files it writes, as `hf-scale generate --help` lists them (``DIR/launch/NAME.sky.yaml``)."""
    summary: str
    """One line: what the files are and how they are started."""
    files: FileWriter
    """Its own files (the shared ones below are written once for all the targets that ask for them)."""
    doc_anchor: str
    """The section of docs/launch.md that documents it (its heading's GitHub anchor)."""
    always: bool = False
    """Written by every `hf-scale generate`, not chosen with --targets (SLURM's sbatch script)."""
    node_script: bool = False
    """Its nodes run ``launch/NAME.node.sh`` (hf_scale.generators.node_entry)."""
    image: bool = False
    """It runs ``cluster.image``: generate requires it and writes the Dockerfile that builds it."""
    source: bool = False
    """Its nodes install this hf_scale from the generated source archive (hf_scale.generators.install)."""
    manifests: tuple[ManifestKind, ...] = ()
    """The job manifests of it that `hf-scale check --manifest` reads."""
    engine: str = ""
    """How check's docs name what runs its jobs ("SLURM", "Kubeflow Trainer (TrainJob)")."""
    node_variables: tuple[tuple[str, str], ...] = ()
    """The counts its engine sets on every node of the job it starts: (variable, :data:`NODES` or
    :data:`PER_NODE`). A launcher given one runs the manifest's own count by construction
    (hf_scale.clusters.PLATFORM_VARIABLES)."""

    def write(self, cfg: DistributedConfig, name: str, *, header: str) -> dict[str, str]:
        """Its own files for a config: relative path -> text."""
        return self.files(cfg, name, header=header)


def env_values(items: Any) -> dict[str, str]:
    """An environment as a manifest writes it, name -> value: a mapping (SkyPilot's envs), or Kubernetes' list of
    ``{name, value}`` (entries without a value, a ``valueFrom``, are left out)."""
    if isinstance(items, dict):
        return {str(k): str(v) for k, v in items.items() if v is not None}
    return {str(item.get("name")): str(item["value"]) for item in items or []
            if isinstance(item, dict) and "value" in item}
