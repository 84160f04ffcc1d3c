"""What a cluster target is: the record each module of hf_scale.clusters declares (its ``TARGET``), which the
registry (hf_scale.clusters.TARGETS) lists and `hf-scale generate`, `hf-scale check --manifest` and the docs read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hf_scale.config.distributed_config import DistributedConfig

FileWriter = Callable[..., dict[str, str]]
"""``writer(cfg, name, *, header=...)`` -> relative path (under generate's output directory) -> file text."""


@dataclass(frozen=True)
class ManifestKind:
    """A job manifest of a target that `hf-scale check --manifest` reads (hf_scale.check.cluster)."""

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

    def write(self, cfg: DistributedConfig, name: str, *, header: str) -> dict[str, str]:
        """Its own files for a config: relative path -> text."""
        return self.files(cfg, name, header=header)
