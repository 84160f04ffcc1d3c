"""What a job manifest says about the run it starts, read from its fields (by its kind's reader,
hf_scale.clusters.target.ManifestKind.fields: each target knows its own) and from the command its nodes run:
nodes, processes and GPUs per node, image, grace period, writable persistent mounts, and the files the command names
(``accelerate launch --config_file``, ``--hf_scale_config``, a DeepSpeed JSON, a generated ``launch/NAME.node.sh``),
found on this machine where they can be (hf_scale.check.cluster compares them).

Processes per node: a count the command's launcher is given (``torchrun --nproc_per_node``, ``accelerate launch
--num_processes`` / ``--num_machines``, ``deepspeed --num_gpus``) is what runs; else the manifest's own
(numProcPerNode, nprocPerNode: the operator hands it to torchrun as PET_NPROC_PER_NODE). ``$VAR`` values are read
from the manifest's env; the variables each engine sets on every node (hf_scale.clusters.PLATFORM_VARIABLES: SkyPilot's
SKYPILOT_NUM_NODES, Kubeflow's PET_NNODES, SLURM's SLURM_NNODES, ...) and torchrun's ``gpu``/``auto`` are the
platform's own count (the manifest's field and the GPU check cover them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_scale.check.train_flags import last_value
from hf_scale.clusters import PLATFORM_VARIABLES
from hf_scale.clusters.target import NODES, PER_NODE, ManifestKind
from hf_scale.config.cluster_section import DEFAULT_IMAGE_HOME
from hf_scale.generators import output_paths

FROM_PLATFORM = "from the platform"
"""A launcher count the platform fills in ($SKYPILOT_NUM_GPUS_PER_NODE, $PET_NNODES, torchrun's `gpu`/`auto`:
one process per GPU): it agrees with the manifest's own count by construction."""
_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))$")
_GPU_VARIABLES = {name for name, (_, counts) in PLATFORM_VARIABLES.items() if counts == PER_NODE}
_NODE_VARIABLES = {name for name, (_, counts) in PLATFORM_VARIABLES.items() if counts == NODES}
_NODE_SCRIPT = re.compile(r"(?:^|/)launch/(?P<name>[A-Za-z0-9_.-]+)\.node\.sh$")


@dataclass(frozen=True)
class Facts:
    nodes: Any
    procs: int | None
    """Processes per node: the launcher's count in the command, else the manifest's field; None when unknown."""
    procs_where: str
    gpus: int | None
    image: str | None
    args: list[str]
    grace: int | None
    mounts: list[str]
    launcher_nodes: int | None = None
    """A node count the command's launcher is given (torchrun --nnodes, accelerate --num_machines)."""
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    launcher_total: int | None = None
    """``accelerate launch --num_processes N`` without --num_machines: the processes of all machines, which accelerate
    splits by the num_machines of the config file it launches (hf_scale.check.cluster does, with that file)."""
    overrides: frozenset[str] = frozenset()
    """What the command's ``accelerate launch`` sets over the config file it launches (NODES: --num_machines,
    PER_NODE: --num_processes), whatever the value ($SKYPILOT_NUM_NODES too)."""


HF_SCALE_CONFIG_FLAGS = ("--hf_scale_config", "--hf-scale-config")
"""train.py's spellings of the flag (its parser takes both, as every dashed flag of HfArgumentParser)."""


def _count(value: str | None, env: dict[str, str], platform: set[str]) -> int | str | None:
    """A launcher flag's value as a count: an int, FROM_PLATFORM (one of the ``platform`` variables), or None
    (unknown: another variable, a word)."""
    if value is None:
        return None
    match = _VARIABLE.fullmatch(value)
    if match:
        variable = match[1] or match[2]
        if variable in platform:
            return FROM_PLATFORM
        value = env.get(variable, value)
    if value in ("gpu", "auto"):
        return FROM_PLATFORM
    return int(value) if value.isdigit() else None


def launcher_counts(args: list[str], env: dict[str, str]) -> tuple[int | str | None, int | str | None, str]:
    """(processes per node, nodes, which launcher) of the first launcher in the command's words."""
    for index, word in enumerate(args):
        rest = args[index + 1:]
        base = word.rsplit("/", 1)[-1]
        if base == "torchrun" or (word == "-m" and rest[:1] in (["torch.distributed.run"],
                                                                 ["torch.distributed.launch"])):
            return (_count(last_value(rest, ("--nproc_per_node", "--nproc-per-node")), env, _GPU_VARIABLES),
                    _count(last_value(rest, ("--nnodes",)), env, _NODE_VARIABLES), "torchrun --nproc_per_node")
        if base == "accelerate" and rest[:1] == ["launch"]:
            total = _count(last_value(rest, ("--num_processes", "--num-processes")), env, set())
            machines = _count(last_value(rest, ("--num_machines", "--num-machines")), env, _NODE_VARIABLES)
            # --num_processes alone is a total whose split comes from the config file: nothing to compare.
            both = isinstance(total, int) and isinstance(machines, int) and machines > 0
            return (total // machines if both else None), machines, "accelerate launch --num_processes / --num_machines"
        if base == "deepspeed":
            return (_count(last_value(rest, ("--num_gpus", "--num-gpus")), env, _GPU_VARIABLES),
                    _count(last_value(rest, ("--num_nodes", "--num-nodes")), env, _NODE_VARIABLES),
                    "deepspeed --num_gpus")
    return None, None, ""


def accelerate_total(args: list[str], env: dict[str, str]) -> int | None:
    """:attr:`Facts.launcher_total` of the command's first launcher, when it is `accelerate launch`."""
    for index, word in enumerate(args):
        base = word.rsplit("/", 1)[-1]
        module = args[index + 1:index + 2] if word == "-m" else []
        if base in ("torchrun", "deepspeed") or module in (["torch.distributed.run"], ["torch.distributed.launch"]):
            return None  # launcher_counts reads the first launcher; so does this
        if base == "accelerate" and args[index + 1:index + 2] == ["launch"]:
            rest = args[index + 2:]
            if last_value(rest, ("--num_machines", "--num-machines")) is not None:
                return None  # both given: launcher_counts splits them
            total = _count(last_value(rest, ("--num_processes", "--num-processes")), env, set())
            return total if isinstance(total, int) and total > 0 else None
    return None


def accelerate_overrides(args: list[str]) -> frozenset[str]:
    """:attr:`Facts.overrides` of the command's first launcher, when it is `accelerate launch`."""
    for index, word in enumerate(args):
        base = word.rsplit("/", 1)[-1]
        module = args[index + 1:index + 2] if word == "-m" else []
        if base in ("torchrun", "deepspeed") or module in (["torch.distributed.run"], ["torch.distributed.launch"]):
            return frozenset()
        if base == "accelerate" and args[index + 1:index + 2] == ["launch"]:
            rest = args[index + 2:]
            flags = {NODES: ("--num_machines", "--num-machines"), PER_NODE: ("--num_processes", "--num-processes")}
            return frozenset(what for what, names in flags.items() if last_value(rest, names) is not None)
    return frozenset()


def manifest_facts(kind: ManifestKind, data: dict) -> Facts:
    """What a manifest of that kind says: its fields as its kind reads them, and the counts its command's launcher
    is given (a launcher's processes per node count over the manifest's own field: it is what runs). Raises
    AttributeError, TypeError or ValueError on a structure that cannot be read."""
    fields = kind.fields(data)
    procs, launcher_nodes, launcher = launcher_counts(fields.args, fields.env)
    if not isinstance(procs, int) and fields.procs_at is not None:
        procs, where = fields.procs, fields.procs_at
    else:
        where = f"{fields.command} {launcher}"
    return Facts(fields.nodes, int(procs) if str(procs).isdigit() else None, where, fields.gpus, fields.image,
                 fields.args, fields.grace, fields.mounts, launcher_nodes if isinstance(launcher_nodes, int) else None,
                 fields.env, fields.workdir, accelerate_total(fields.args, fields.env),
                 accelerate_overrides(fields.args))


OUTPUT_DIR_FLAGS = ("--output_dir", "--output-dir")
_TRAIN_SCRIPT = re.compile(r"(?:^|/)train\.py$")
_SHELL_SEPARATORS = {";", "&&", "||", "|", "&"}
_EXPANSION = re.compile(r"[$`]")


@dataclass(frozen=True)
class TrainCommand:
    """What the command hands train.py."""

    args: list[str]
    """The words after ``train.py``, ``-m hf_scale.train`` or a generated ``launch/NAME.node.sh`` (which passes them
    on), up to the end of that shell command; whole-word ``$VAR``s read from the manifest's env."""
    unresolved: list[str]
    """Words with a shell expansion this machine cannot know (``$OTHER``, ``$(...)``): the flags are then not
    parsed (their values are the job's), only --output_dir is read."""
    passes_config: bool
    """An hf_scale config reaches train.py: ``--hf_scale_config`` among the arguments, or NAME.node.sh's own."""
    script: str = ""
    """The word that runs it: ``-m hf_scale.train``, a train.py path, a launch/NAME.node.sh."""
    hf_scale: bool = False
    """Certainly hf_scale's training: ``-m hf_scale.train``, a generated node script, or ``--hf_scale_config``; a
    ``train.py`` of no such mark may be a script of its own (SkyPilot's gpt-oss task runs TRL's /sft/train.py)."""


def train_command(facts: Facts) -> TrainCommand | None:
    """The train.py invocation of the command; None when it runs none that can be recognized (a script of its own:
    nothing to parse)."""
    args = facts.args
    for index, word in enumerate(args):
        module = word == "-m" and args[index + 1:index + 2] == [output_paths.TRAINING_MODULE]
        if not (module or _TRAIN_SCRIPT.search(word) or _NODE_SCRIPT.search(word)):
            continue
        words = []
        for arg in args[index + (2 if module else 1):]:
            if arg in _SHELL_SEPARATORS:
                break
            words.append(arg.removesuffix(";"))
            if arg.endswith(";"):
                break
        words = [_substituted(arg, facts.env) for arg in words]
        passes = bool(_NODE_SCRIPT.search(word)) or any(a.partition("=")[0] in HF_SCALE_CONFIG_FLAGS for a in words)
        script = f"-m {output_paths.TRAINING_MODULE}" if module else word
        return TrainCommand(words, [arg for arg in words if _EXPANSION.search(arg)], passes, script,
                            module or passes)
    return None


def _substituted(word: str, env: dict[str, str]) -> str:
    match = _VARIABLE.fullmatch(word)
    return env.get(match[1] or match[2], word) if match else word


def output_dir(facts: Facts) -> str | None:
    """--output_dir as train.py reads it: the last one given (argparse's rule), among train.py's arguments when the
    command's train.py is recognized, else among all its words."""
    command = train_command(facts)
    return last_value(command.args if command else facts.args, OUTPUT_DIR_FLAGS)


def _resolve(written: str, manifest: Path, workdir: str | None) -> Path | None:
    """A path in the command as a file on this machine: the image's generated directory (DEFAULT_IMAGE_HOME) is
    the one the manifest was generated into (the parent of its launch/); a relative path is tried against the
    SkyPilot workdir, that directory, the manifest's own and the current one. None when none exists."""
    folder = manifest.parent
    generated = [folder.parent] if folder.name == "launch" else []
    if written.startswith(f"{DEFAULT_IMAGE_HOME}/"):
        written, bases = written[len(DEFAULT_IMAGE_HOME) + 1:], [*generated, folder, Path.cwd()]
    elif Path(written).is_absolute():
        return Path(written) if Path(written).is_file() else None
    else:
        bases = [folder / workdir] if workdir else []
        bases += [*generated, folder, Path.cwd()]
    return next((base / written for base in bases if (base / written).is_file()), None)


def named_files(facts: Facts, manifest: Path) -> dict[str, tuple[str, Path]]:
    """The files the command names that exist here: {"accelerate"|"hf_scale"|"deepspeed": (flag and path as
    written, path here)}.
    A generated launch/NAME.node.sh names its hf_scale_configs/NAME.yaml (it passes it to train.py)."""
    found: dict[str, tuple[str, Path]] = {}
    wanted = {"accelerate": ("--config_file", "--config-file"), "hf_scale": HF_SCALE_CONFIG_FLAGS,
              "deepspeed": ("--deepspeed", "--deepspeed_config_file", "--deepspeed-config-file")}
    for kind, flags in wanted.items():
        written = last_value(facts.args, flags)
        path = _resolve(written, manifest, facts.workdir) if written else None
        if path is not None:
            flag = next(arg.partition("=")[0] for arg in facts.args if arg.partition("=")[0] in flags)
            found[kind] = (f"{flag} {written}", path)
    if "hf_scale" not in found:
        for word in facts.args:
            match = _NODE_SCRIPT.search(word)
            script = _resolve(word, manifest, facts.workdir) if match else None
            config = script.parent.parent / output_paths.hf_scale_config(match["name"]) if script else None
            if config is not None and config.is_file():
                found["hf_scale"] = (f"{word}, which passes it as --hf_scale_config", config)
                break
    return found
