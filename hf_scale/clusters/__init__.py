"""Cluster targets: one module per target (hf_scale/clusters/NAME.py, its ``TARGET``), listed once in
:data:`TARGETS`. `hf-scale generate` (its --targets choices, its help, the files it writes), `hf-scale check
--manifest` (which manifests it recognises) and the docs read this registry; no other module names a target.

Adding a target: one module here with its ``TARGET`` (whose ``ManifestKind``s say how `hf-scale check --manifest`
reads and validates its manifests: hf_scale.check names no kind), an entry in :data:`TARGETS`, its test
(tests/clusters/test_NAME.py) and its section in docs/launch.md (CONTRIBUTING.md).
"""

from __future__ import annotations

from hf_scale.clusters import docker, kubeflow, pytorchjob, ray, skypilot, slurm
from hf_scale.clusters.target import ClusterTarget, ManifestKind
from hf_scale.config.distributed_config import DistributedConfig
from hf_scale.errors import UserError
from hf_scale.generators import install, node_entry, output_paths

TARGETS: tuple[ClusterTarget, ...] = (
    slurm.TARGET, kubeflow.TARGET, pytorchjob.TARGET, skypilot.TARGET, ray.TARGET, docker.TARGET,
)
"""Every cluster target, in the order generate writes and lists them."""

CHOSEN = tuple(target.name for target in TARGETS if not target.always)
"""The targets `hf-scale generate --targets` chooses from (the others are written every time)."""

MANIFEST_KINDS: tuple[ManifestKind, ...] = tuple(kind for target in TARGETS for kind in target.manifests)
"""Every job manifest `hf-scale check --manifest` reads."""


def _platform_variables() -> dict[str, tuple[str, str]]:
    engines: dict[str, list[str]] = {}
    counts: dict[str, str] = {}
    for each in TARGETS:
        for variable, what in each.node_variables:
            engines.setdefault(variable, []).append(each.engine)
            counts[variable] = what
    return {variable: (", ".join(names), counts[variable]) for variable, names in engines.items()}


PLATFORM_VARIABLES: dict[str, tuple[str, str]] = _platform_variables()
"""The counts each engine sets on every node of the job it starts (variable: (engines, what it counts: NODES or
PER_NODE)), from the targets' node_variables: a launcher given one of them runs the manifest's own count by
construction (hf_scale.check.manifest_facts; docs/check.md lists them)."""


def target(name: str) -> ClusterTarget:
    """The registered target of that name."""
    return next(t for t in TARGETS if t.name == name)


def image_targets(names: tuple[str, ...] | list[str]) -> list[str]:
    """Those of the named targets that run cluster.image (generate refuses them without one)."""
    return [t.name for t in TARGETS if t.name in names and t.image]


def recognised_manifest(data: object) -> ManifestKind:
    """The manifest kind a parsed YAML document is; a UserError naming every kind when it is none."""
    for kind in MANIFEST_KINDS:
        if kind.recognises(data):
            return kind
    raise UserError(f"the manifest is {manifest_kinds_text('neither', 'nor')}")


def manifest_kinds_text(first: str = "", last: str = "or", *, how: bool = True) -> str:
    """Every manifest kind, with what recognises it unless not ``how``: "a TrainJob, a PyTorchJob (kind:) or a
    SkyPilot task (run:, num_nodes:)" (``first`` before the list, ``last`` before its last entry)."""
    groups: list[list[ManifestKind]] = []
    for kind in MANIFEST_KINDS:  # neighbours recognised the same way share their parenthesis
        if groups and groups[-1][-1].how_recognised == kind.how_recognised:
            groups[-1].append(kind)
        else:
            groups.append([kind])
    items = [", ".join(kind.article for kind in group) + (f" ({group[-1].how_recognised})" if how else "")
             for group in groups]
    text = f"{', '.join(items[:-1])} {last} {items[-1]}" if len(items) > 1 else items[0]
    return f"{first} {text}" if first else text


def standard_files(cfg: DistributedConfig, name: str, *, header: str) -> dict[str, str]:
    """The files of the targets every `hf-scale generate` writes (SLURM's sbatch script)."""
    files: dict[str, str] = {}
    for each in TARGETS:
        if each.always:
            files.update(each.write(cfg, name, header=header))
    return files


def cluster_files(
    cfg: DistributedConfig, name: str, targets: tuple[str, ...], *, header: str
) -> dict[str, str | bytes]:
    """Relative path -> text for the chosen targets (:data:`CHOSEN`): each one's own files, plus, once for all
    that ask for them, the node entry script (hf_scale.generators.node_entry), the Dockerfile of the image they run
    (the docker target's files) and hf_scale itself as a source archive (bytes) with its pinned dependencies
    (hf_scale.generators.install)."""
    unknown = [each for each in targets if each not in CHOSEN]
    if unknown:
        raise ValueError(f"unknown target {unknown[0]!r}; allowed: {', '.join(CHOSEN)}")
    chosen = [each for each in TARGETS if each.name in targets]
    files: dict[str, str | bytes] = {}
    if any(each.node_script for each in chosen):
        files[output_paths.launch_file(f"{name}.node.sh")] = node_entry.node_script(cfg, name, header=header)
    for each in chosen:
        files.update(each.write(cfg, name, header=header))
    if any(each.image for each in chosen):
        files.update(docker.TARGET.write(cfg, name, header=header))
    if any(each.source for each in chosen):
        files[output_paths.REQUIREMENTS_FILE] = install.requirements()
        files[output_paths.SOURCE_ARCHIVE] = install.source_archive()
    return files
