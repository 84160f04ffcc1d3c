"""`hf-scale check --manifest FILE`: a job manifest of a cluster target (generated or hand-written, recognized by
its content: hf_scale.clusters.recognised_manifest) against the configs of the run it starts, and against what a
restartable job needs. Everything that differs between kinds is the kind's own (its target's
hf_scale.clusters.target.ManifestKind: how its fields read, what its platform refuses, how a secret is passed, its
own image and restart rules); nothing here names a kind.

The configs: the accelerate YAML and the hf_scale config given to check, and the files the manifest's command names
where they can be found here (``accelerate launch --config_file``, ``--hf_scale_config``, a DeepSpeed JSON, a
generated ``launch/NAME.node.sh``'s hf_scale config: hf_scale.check.manifest_facts); each is compared.

`manifest-invalid`: the platform's own definitions refuse the manifest (Kubeflow's API models, SkyPilot's schemas:
the kind's ``problem``). `manifest-nodes`, `manifest-processes`: node count vs num_machines /
topology.num_machines, processes per node (the command's launcher count, else numProcPerNode / nprocPerNode; an
``accelerate launch --num_processes`` total split by the num_machines of the accelerate config it launches) vs
num_processes / num_machines or topology.processes_per_machine. `manifest-gpus`: GPUs per node (the GPU resource,
the SkyPilot accelerator count) vs processes per node. `manifest-image`: the image has a version tag or digest (not
`latest`, not none). `manifest-output-volume`: --output_dir is on a writable persistent volume (a PVC, a bucket in
MOUNT mode), so a restarted node finds the checkpoints. `manifest-grace-period` (Kubernetes):
terminationGracePeriodSeconds vs saving one checkpoint: measured from ``--checkpoint DIR`` (from its oldest file to
its manifest, written last), else at least GRACE_FLOOR_S (the documented estimate: the rest of a step plus one save
of a multi-GB state). `manifest-deepspeed-batch`: a DeepSpeed JSON's concrete `train_batch_size` against the world
size the manifest starts (nodes x processes per node): DeepSpeed asserts train_batch_size = micro batch x
accumulation x world size at start, on the cluster, after the job has queued. `manifest-train-args`: the arguments
the command hands train.py (after ``train.py``, ``-m hf_scale.train`` or a generated ``launch/NAME.node.sh``) are
parsed by train.py's own parser: an unknown flag, a bad value, or a flag contradicting the hf_scale config train.py
gets is what train.py stops on, at start. --output_dir is read as train.py reads it: the last one given.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hf_scale.check.batch import deepspeed_accepts_batch
from hf_scale.check.findings import ERROR, WARNING, Finding
from hf_scale.check.manifest_facts import (
    HF_SCALE_CONFIG_FLAGS,
    Facts,
    TrainCommand,
    manifest_facts,
    named_files,
    output_dir,
    train_command,
)
from hf_scale.clusters import recognised_manifest
from hf_scale.clusters.target import NODES, ManifestKind, ManifestNote
from hf_scale.config.cluster_section import image_problem
from hf_scale.errors import UserError
from hf_scale.generators import output_paths
from hf_scale.knowledge.rules import is_secret_setting

GRACE_FLOOR_S = 120
"""Without a measured save: the least grace period we call safe (Kubernetes' default, 30 s, is not)."""
GRACE_MARGIN = 2.0
"""The grace period must cover the measured save this many times (the step in progress, a slower filesystem)."""


def manifest_kind(data: Any) -> str:
    """The name of the kind of job manifest a YAML document is (one of hf_scale.clusters.MANIFEST_KINDS); a
    UserError naming every kind when it is none."""
    return recognised_manifest(data).kind


def _count(value: Any) -> int | None:
    """A count as `accelerate launch` reads it (int()), None when it is none (`auto`, a word: other findings)."""
    try:
        return int(value) if not isinstance(value, bool) and value is not None else None
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class Reference:
    """One config of the run the manifest starts: its sizes."""

    label: str
    """e.g. "the accelerate config a.yaml", "the hf_scale config x.yaml (named by job.yaml's command as ...)"."""
    key: str
    nodes: int | None
    per_node: int | None
    cpu: bool = False


def accelerate_reference(label: str, data: dict) -> Reference:
    machines = _count(data.get("num_machines", 1)) or 1
    # `num_processes: auto` (one per GPU, torchrun's choice) or a value the YAML checks report: nothing to compare.
    processes = _count(data.get("num_processes", 1))
    return Reference(f"the accelerate config {label}", "accelerate", machines,
                     processes // machines if processes else None, data.get("use_cpu") is True)


def hf_scale_reference(label: str, cfg: Any) -> Reference:
    topology = cfg.topology
    return Reference(f"the hf_scale config {label}", "hf_scale", topology.num_machines,
                     topology.processes_per_machine)


def _deepspeed_batch(path: str, kind: str, facts: Facts, deepspeed: dict, label: str) -> Iterator[Finding]:
    """DeepSpeed's start-up assertion, train_batch_size == micro x accumulation x world size, with the world size
    this manifest starts; "auto" values are resolved by the Trainer from the real world size (nothing to compare)."""
    per_node = facts.procs or facts.gpus
    nodes = _count(facts.nodes)
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
                  f"{kind} starts {world} processes and the DeepSpeed config{label} says {problem}: DeepSpeed stops "
                  "at start", 'set train_batch_size (and the micro batch / accumulation) to "auto", or to values '
                  "whose product is this world size's",
                  {f"{path}:world_size": world, "deepspeed:train_batch_size": batch})


def _size_findings(path: str, manifest: ManifestKind, facts: Facts, ref: Reference) -> Iterator[Finding]:
    """`manifest-nodes`, `manifest-processes`, `manifest-gpus` against one config."""
    kind, where = manifest.kind, manifest.gpus_at
    per_machine = ref.per_node
    nodes = [count for count in (_count(facts.nodes), facts.launcher_nodes) if count is not None]
    wrong = next((count for count in nodes if count != ref.nodes), None) if ref.nodes is not None else None
    if wrong is not None or (ref.nodes is not None and not nodes):
        yield Finding(ERROR, "manifest-nodes", path, "numNodes/replicas/num_nodes",
                      f"{kind} runs {wrong if wrong is not None else facts.nodes} node(s); {ref.label} has "
                      f"{ref.nodes}", "make them equal (world size = nodes x processes per node)",
                      {f"{path}:nodes": wrong if wrong is not None else facts.nodes, f"{ref.key}:nodes": ref.nodes})
    if None not in (facts.procs, per_machine) and facts.procs != per_machine:
        yield Finding(ERROR, "manifest-processes", path, f"{where} processes per node",
                      f"{kind} starts {facts.procs} process(es) per node ({facts.procs_where}); {ref.label} has "
                      f"{per_machine} per machine", "make them equal",
                      {f"{path}:processes": facts.procs, f"{ref.key}:per_machine": per_machine})
    if None not in (facts.gpus, per_machine) and facts.gpus != per_machine and not ref.cpu:
        yield Finding(ERROR, "manifest-gpus", path, f"{where} GPUs",
                      f"{kind} gives each node {facts.gpus} GPU(s); {ref.label} has {per_machine} process(es) "
                      "per machine",
                      "one GPU per process: set the GPU count to the processes per machine",
                      {f"{path}:gpus": facts.gpus, f"{ref.key}:per_machine": per_machine})


def _accelerate_split(facts: Facts, references: list[Reference]) -> Facts:
    """``accelerate launch --num_processes N`` alone overrides the config file's total: accelerate starts N //
    num_machines per machine, num_machines read from the file it launches (the one the command names, else the
    accelerate config given to check). Without such a file here the split is unknown: nothing to compare."""
    total = facts.launcher_total
    yaml = next((ref for ref in references if ref.key == "accelerate" and ref.nodes), None)
    if total is None or yaml is None:
        return facts
    return replace(facts, procs=total // yaml.nodes,
                   procs_where=f"the command's accelerate launch --num_processes {total} over num_machines="
                   f"{yaml.nodes} of {yaml.label.removeprefix('the accelerate config ')}")


def measured_save_seconds(checkpoint_dir: Path) -> float:
    """How long saving `checkpoint_dir` took: from its oldest file to its manifest (written last, hf_scale's)."""
    from hf_scale.contract.checkpoint_layout import MANIFEST

    files = [f for f in checkpoint_dir.rglob("*") if f.is_file()]
    manifest = checkpoint_dir / MANIFEST
    if not manifest.is_file() or not files:
        raise UserError(f"--checkpoint {checkpoint_dir}: not a complete hf_scale checkpoint (no {MANIFEST})")
    return max(0.0, manifest.stat().st_mtime - min(f.stat().st_mtime for f in files))


@dataclass(frozen=True)
class Named:
    """The configs the manifest's command names that exist here."""

    references: list[Reference]
    deepspeed: dict | None = None
    deepspeed_label: str = ""
    hf_scale: tuple[str, Any] | None = None
    """(its path as written in the command, the DistributedConfig) of the hf_scale config train.py gets."""


def _named_references(path: str, facts: Facts, known: set[Path]) -> Named:
    """The configs the manifest's command names and that exist here (those already given are not compared twice),
    and its DeepSpeed JSON with a label, if it names one."""
    from hf_scale.config.distributed_config import load_config
    from hf_scale.files.reading import load_json, load_yaml, read_text

    references, deepspeed, ds_label, hf_scale = [], None, "", None
    for kind, (written, file) in named_files(facts, Path(path)).items():
        label = f"{file} (the command's {written})"
        if kind == "hf_scale":
            cfg = load_config(file)
            hf_scale = (str(file), cfg)
            if file.resolve() not in known:
                references.append(hf_scale_reference(label, cfg))
        elif file.resolve() in known:
            continue
        elif kind == "accelerate":
            data = load_yaml(read_text(file, "check:"), f"check: {file}")
            if isinstance(data, dict):
                references.append(accelerate_reference(label, data))
        else:
            data = load_json(read_text(file, "check:"), f"check: {file}")
            deepspeed, ds_label = (data, f" {file}") if isinstance(data, dict) else (None, "")
    return Named(references, deepspeed, ds_label, hf_scale)


def _not_hf_scale(path: str, kind: str, why: str) -> Finding:
    """`manifest-not-hf-scale` (warning): the job runs a training of its own; what applies to any job is compared."""
    return Finding(WARNING, "manifest-not-hf-scale", path, "command",
                   f"{kind} {why}: taken as a training of its own, only the schema, sizes, GPUs and image tag are "
                   "compared (not train.py's arguments, the output volume or the grace period)",
                   f"nothing to do if {Path(path).name} is not meant to run hf_scale; else run -m "
                   f"{output_paths.TRAINING_MODULE} (or train.py with --hf_scale_config) in its command")


def _train_args_findings(path: str, kind: str, facts: Facts, config: tuple[str, Any] | None) -> list[Finding]:
    """`manifest-train-args`: the arguments the command hands train.py, parsed by train.py's own parser
    (hf_scale.check.train_flags) and compared with the hf_scale config train.py gets (``config``: its path and
    DistributedConfig, when it is known here). `manifest-not-hf-scale`: the command runs no hf_scale training, or a
    train.py of no hf_scale mark (hf_scale.check.manifest_facts.TrainCommand.hf_scale) whose arguments hf_scale's
    parser refuses or cannot read here (``$VAR``, ``$(...)``): a script of its own (SkyPilot's gpt-oss task runs
    TRL's /sft/train.py --model_id ...)."""
    command = train_command(facts)
    if command is None:
        return [_not_hf_scale(path, kind, f"runs no hf_scale training (no -m {output_paths.TRAINING_MODULE}, "
                                          "launch/NAME.node.sh or train.py in its command)")]
    if command.unresolved and not command.hf_scale:
        # Values that are the job's ($VAR, $(...)) cannot be parsed here, so nothing shows this train.py is hf_scale's.
        return [_not_hf_scale(path, kind, f"runs {command.script} with values only the job knows "
                                          f"({' '.join(command.unresolved)}) and no hf_scale mark (-m "
                                          f"{output_paths.TRAINING_MODULE}, launch/NAME.node.sh or --hf_scale_config)")]
    if command.unresolved:
        return []  # hf_scale's, with values that are the job's: nothing certain to parse
    return list(_parsed_train_args(path, kind, command, config))


def _parsed_train_args(path: str, kind: str, command: TrainCommand,
                       config: tuple[str, Any] | None) -> Iterator[Finding]:
    from hf_scale.check.train_flags import against_config, parse_train_flags

    # The hf_scale config is compared as a DistributedConfig (below); its path is the image's, not this machine's.
    words, skip = [], False
    for word in command.args:
        if skip or word.partition("=")[0] in HF_SCALE_CONFIG_FLAGS:
            skip = not skip and "=" not in word
            continue
        words.append(word)
    fix = "fix the arguments of the manifest's command (python train.py --help lists train.py's flags)"
    try:
        flags = parse_train_flags(words, read_recipe=False)  # a recipe in the image is train.py's to read
    except UserError as error:
        if not command.hf_scale:
            yield _not_hf_scale(path, kind, f"runs {command.script} with arguments hf_scale's train.py refuses "
                                            f"({error}), so not hf_scale's (were it, the job would fail at start)")
            return
        yield Finding(ERROR, "manifest-train-args", path, "train.py arguments",
                      f"{kind} hands train.py arguments it refuses: {error}: the job fails at start, after it "
                      "queued", fix, {f"{path}:train.py arguments": " ".join(words)})
        return
    if config is None or not command.passes_config:
        return
    file, cfg = config
    for contradiction in against_config(flags, cfg, f"--hf_scale_config={file}").contradictions:
        yield Finding(ERROR, "manifest-train-args", path, "train.py arguments",
                      f"{contradiction}: train.py stops at start on this, after the job queued",
                      f"drop the flag from the manifest's command (the config decides it), or change {file} and "
                      "regenerate", {f"{path}:train.py arguments": " ".join(words)})


def check_manifest(path: str, data: Any, references: list[Reference], *, save_seconds: float | None = None,
                   deepspeed: dict | None = None, given_files: tuple[str, ...] = (),
                   hf_scale_config: tuple[str, Any] | None = None) -> Iterator[Finding]:
    """`manifest-invalid`, `manifest-nodes`, `manifest-processes`, `manifest-gpus`, `manifest-image`,
    `manifest-output-volume`, `manifest-grace-period`, `manifest-deepspeed-batch`, `manifest-train-args`: see the
    module docstring. ``references``: the configs given to check; ``given_files`` their paths (a file the command
    names too is compared once); ``hf_scale_config``: the hf_scale config given (its path and DistributedConfig),
    compared with train.py's arguments when the command passes train.py one that cannot be found here."""
    manifest = recognised_manifest(data)
    kind = manifest.kind
    problem = manifest.problem(data)
    if problem:
        yield Finding(ERROR, "manifest-invalid", path, kind, problem,
                      f"fix the {kind} ({manifest.refused_by} would refuse it)")
    try:
        facts = manifest_facts(manifest, data)
    except (AttributeError, TypeError, ValueError):
        if problem:  # a structure the platform refuses (reported above) has nothing more to compare
            return
        raise UserError(f"--manifest {path}: its {kind} structure cannot be read (a mapping or list where the "
                        "other is expected?)") from None
    named = _named_references(path, facts, {Path(f).resolve() for f in given_files})
    # accelerate launch's --num_processes is split over the machines before anything counts processes.
    facts = _accelerate_split(facts, [*named.references, *references])
    if deepspeed is not None or named.deepspeed is not None:
        yield from _deepspeed_batch(path, kind, facts, deepspeed if deepspeed is not None else named.deepspeed,
                                    "" if deepspeed is not None else named.deepspeed_label)
    own = _train_args_findings(path, kind, facts, named.hf_scale or hf_scale_config)
    yield from own
    runs_hf_scale = not any(finding.code == "manifest-not-hf-scale" for finding in own)
    compared = set()
    for reference in [*references, *named.references]:
        if reference.key == "accelerate" and NODES in facts.overrides:
            # `accelerate launch --num_machines` overrides the file's num_machines, and so its split of processes
            # per machine ($SKYPILOT_NUM_NODES: the manifest's own count): the file's counts are not what runs.
            reference = replace(reference, nodes=None, per_node=None)
        sizes = (reference.nodes, reference.per_node, reference.cpu)
        if sizes not in compared:  # configs that agree (a generated YAML and its hf_scale config): one finding
            compared.add(sizes)
            yield from _size_findings(path, manifest, facts, reference)
    yield from _image_findings(path, manifest, data, facts, runs_hf_scale)
    yield from _secret_findings(path, manifest, facts)
    if not runs_hf_scale:
        return
    for note in manifest.restart_notes(data, Path(path).name):
        yield _noted("manifest-restart-policy", path, note)
    output = output_dir(facts)
    on_volume = output is not None and any(
        mount and (output == mount or output.startswith(mount.rstrip("/") + "/")) for mount in facts.mounts)
    if not on_volume:
        yield Finding(ERROR, "manifest-output-volume", path, "--output_dir",
                      f"--output_dir {output!r} is not on a writable persistent volume "
                      f"({'mounts: ' + ', '.join(facts.mounts) if facts.mounts else 'none mounted'}): "
                      "a restarted node would start afresh", "mount a PVC (Kubernetes) or a bucket in MOUNT mode "
                      "(SkyPilot) and put --output_dir under it")
    if facts.grace is not None:
        need = GRACE_MARGIN * save_seconds if save_seconds is not None else GRACE_FLOOR_S
        if facts.grace < need:
            basis = (f"{GRACE_MARGIN:g} x the measured save of {save_seconds:.0f} s" if save_seconds is not None
                     else f"{GRACE_FLOOR_S} s (no --checkpoint to measure a save)")
            yield Finding(ERROR if save_seconds is not None else WARNING, "manifest-grace-period", path,
                          "terminationGracePeriodSeconds",
                          f"a grace period of {facts.grace} s may end before the checkpoint is saved; needs "
                          f"{basis}", f"set terminationGracePeriodSeconds >= {need:.0f}")


def _noted(code: str, path: str, note: ManifestNote, fix: str = "") -> Finding:
    """The finding a kind's own rule noted (``fix``: the code's own, for a note that has none)."""
    return Finding(WARNING if note.warning else ERROR, code, path, note.key, note.problem,
                   note.fix if note.fix is not None else fix)


def _image_findings(path: str, manifest: ManifestKind, data: dict, facts: Facts,
                    runs_hf_scale: bool) -> Iterator[Finding]:
    """`manifest-image`: a pinned tag (not `latest`, not none); a manifest without an image is what its kind says
    (``missing_image``: a container Kubernetes refuses, a runtime that supplies one, nothing to check)."""
    fix = "use a pinned image, e.g. registry.example.com/team/hf-scale:0.1.0"
    if facts.image:
        issue = image_problem(facts.image)
        if issue:
            yield Finding(ERROR, "manifest-image", path, "image", f"image {facts.image!r} {issue}", fix)
        return
    note = manifest.missing_image(data, runs_hf_scale, Path(path).name)
    if note is not None:
        yield _noted("manifest-image", path, note, fix)


def _secret_findings(path: str, manifest: ManifestKind, facts: Facts) -> Iterator[Finding]:
    """`manifest-secret` (warning): a credential written in plain text in the manifest's env (anyone who can read
    the job, `kubectl get -o yaml`, `sky status`, reads it); a `$VAR` or a Secret reference is fine. What a
    credential is: the rule `cluster.env` is refused by (rules.is_secret_setting); how to pass one instead: the
    kind's ``secret_via``."""
    for name, value in facts.env.items():
        if value and not str(value).startswith("$") and is_secret_setting(name, value):
            yield Finding(WARNING, "manifest-secret", path, f"env.{name}",
                          f"{name} is written in plain text in the {manifest.kind}'s env: whoever can read the job "
                          "reads it", f"remove the value from {Path(path).name} and pass {name} through "
                          f"{manifest.secret_via.format(name=name)}")
