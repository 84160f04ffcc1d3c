"""`hf-scale generate`, `hf-scale presets` and `hf-scale schema`.

``generate`` validates everything (config, overrides, name, output directory, files it would replace)
before writing anything, then writes each file atomically (temporary file + rename). It refuses to
replace a file whose content differs unless ``--force``: a hand-edited YAML is never lost silently;
identical files are left untouched.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import textwrap
from pathlib import Path

from hf_scale.clusters import CHOSEN, TARGETS, image_targets
from hf_scale.commands.plan import (
    NothingFits,
    add_plan_arguments,
    check_counts,
    plan_argv,
    plan_defaults,
    plan_flag_names,
    plan_from_args,
)
from hf_scale.config.distributed_config import DistributedConfig, config_from_data, config_warnings, load_config
from hf_scale.config.presets import PRESETS, load_preset
from hf_scale.config.value_types import name_problem
from hf_scale.contract.deepspeed_json import MODES
from hf_scale.errors import UserError
from hf_scale.files.writing import already_written, write_files_together
from hf_scale.generators import output_paths, render_files
from hf_scale.knowledge import rules
from hf_scale.planner.rank import planned_config_data
from hf_scale.planner.rank import train_flags as train_flags_of
from hf_scale.planner.report import verdict_lines

_EXECUTABLE_SUFFIXES = (".sh", ".sbatch")

_EPILOG = """\
writes (DIR defaults to the current directory):
  DIR/accelerate_configs/NAME.yaml   for `accelerate launch --config_file`
  DIR/ds_configs/NAME.json           DeepSpeed config (strategy deepspeed only)
  DIR/launch/NAME.accelerate.sh      accelerate launch on one machine (every strategy)
  DIR/launch/NAME.torchrun.sh        torchrun (not for fsdp, which needs accelerate's plugin)
  DIR/launch/NAME.deepspeed.sh       deepspeed launcher (+ NAME.hostfile for multi-node)
<ALWAYS>  DIR/recipes/NAME.yaml              with --recipe: a starter train.py recipe with the config's batch,
                                     precision, clipping and optimizer values (bash launch/NAME.*.sh recipes/NAME.yaml)
with --targets (comma-separated, or repeated; settings in the config's `cluster` section):
<CHOSEN>
--deepspeed-mode auto (default) leaves "auto" exactly where the HF Trainer fills values from its
flags (batch sizes, accumulation, clipping, AdamW lr/betas/eps/weight_decay); resolved writes the
config's numbers everywhere (manual Accelerator loop, `deepspeed` launcher).

An existing file with different content is not replaced unless --force. Warnings about risky but
legal settings go to stderr as `hf-scale: warning: ...`.

examples:
  hf-scale generate --preset zero3
  hf-scale generate --preset zero2 --set deepspeed.offload_optimizer=cpu --name zero2_cpu
  hf-scale generate my_run.yaml --set topology.processes_per_machine=4 --set batch.global_batch_size=64
  hf-scale generate --preset ddp_multinode --set topology.main_process_ip=10.1.2.3 --output-dir runs/a
  hf-scale generate --preset zero3_offload --deepspeed-mode resolved --set deepspeed.torch_adam=true
  hf-scale generate --strategy auto --model meta-llama/Llama-3.1-8B --gpu-memory 80GiB --seq-len 4096
  hf-scale generate --preset zero3 --num-machines 2 --gpus-per-machine 4 --set topology.main_process_ip=10.1.2.3

--strategy auto runs `hf-scale plan` on --model with the planning flags (above) and generates the
recommended config (default NAME: the recommended entry of the strategy catalogue, `hf-scale presets`, e.g. zero2,
or with a size and activation checkpointing, fsdp2_tp4_ac); --set still applies on top.
Without --strategy auto, the planning flags that are a field of the config (--num-machines,
--gpus-per-machine, --micro-batch-size, --precision, --activation-checkpointing on|off) set it as --set would,
before the --set overrides; the others (--gpu-memory, --seq-len, ...) need --strategy auto.

exit codes: 0 written, 1 --strategy auto found no strategy that fits (nothing written), 2 bad input (one line
on stderr, nothing written).
"""


def _names(targets: list[str]) -> str:
    return ", ".join(targets[:-1]) + f" and {targets[-1]}" if len(targets) > 1 else "".join(targets)


def generate_epilog() -> str:
    """generate's --help epilog, the cluster targets' lines read from their registry (hf_scale.clusters)."""
    always = "".join(f"  {t.writes:<34} {t.summary}\n" for t in TARGETS if t.always)
    chosen = [t for t in TARGETS if not t.always]
    lines = "".join(f"  {t.name:<11} {t.writes:<32} {t.summary}\n" for t in chosen)
    shared = textwrap.fill(
        f"{_names([t.name for t in chosen if t.node_script])} also write DIR/launch/NAME.node.sh, each node's entry "
        f"point; {_names([t.name for t in chosen if t.image])} DIR/Dockerfile and DIR/.dockerignore; "
        f"{_names([t.name for t in chosen if t.source])} DIR/{output_paths.SOURCE_ARCHIVE} (this hf_scale, which the "
        f"image and the nodes install: it is not on PyPI) and DIR/{output_paths.REQUIREMENTS_FILE} (its dependencies, "
        "pinned).", width=110, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False)
    return _EPILOG.replace("<ALWAYS>", always).replace("<CHOSEN>\n", lines + shared + "\n\n")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the generate, presets and schema sub-commands."""
    generate = subparsers.add_parser(
        "generate",
        description="Validate a DistributedConfig (a YAML file or a preset, plus --set overrides) and write "
        "every file needed to launch it.",
        epilog=generate_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    generate.add_argument("config", nargs="?", metavar="CONFIG.yaml", help="DistributedConfig YAML file")
    generate.add_argument("--preset", metavar="NAME", help="start from a preset (see `hf-scale presets`)")
    generate.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field by its dotted path, value parsed as YAML (repeatable), "
        "e.g. --set deepspeed.zero_stage=3 --set optimizer.betas=[0.9,0.95]",
    )
    generate.add_argument(
        "--name", help="base name of the generated files (default: the preset name or the config file's stem)"
    )
    generate.add_argument(
        "--output-dir",
        default=".",
        metavar="DIR",
        help="directory to write into (default: current directory)",
    )
    generate.add_argument(
        "--deepspeed-mode",
        choices=MODES,
        default="auto",
        help='DeepSpeed JSON: "auto" values for the HF Trainer (default) or resolved numbers',
    )
    generate.add_argument("--force", action="store_true", help="replace existing files whose content differs")
    generate.add_argument(
        "--recipe",
        action="store_true",
        help="also write recipes/NAME.yaml, a starter train.py recipe consistent with the config",
    )
    generate.add_argument(
        "--targets",
        type=_targets,
        action="extend",  # repeated --targets add up (a later one must not silently drop an earlier one's)
        default=[],
        metavar="T1,T2",
        help=f"also write cluster files: {', '.join(CHOSEN)} (see below; repeatable: the targets add up)",
    )
    generate.add_argument(
        "--strategy",
        choices=("auto",),
        help="auto: plan the fastest strategy that fits --model on the hardware given by the planning flags",
    )
    generate.add_argument(
        "--model", metavar="MODEL", help="with --strategy auto: Hub id, model directory or config.json"
    )
    fields = ", ".join(plan_flag_names()[dest] for dest in PLAN_FLAG_FIELDS)
    add_plan_arguments(generate, description=textwrap.fill(
        "With --strategy auto: the hardware and training to plan for (the defaults below). Without it: "
        f"{fields} (on|off) set the config's field as --set would, before the --set overrides (left out, the "
        "config's value stays); the others need --strategy auto.", width=100, break_on_hyphens=False))
    # None marks a planning flag not typed: without --strategy auto only typed ones apply (_planning_flags).
    generate.set_defaults(func=run_generate, **dict.fromkeys(plan_defaults()))

    presets = subparsers.add_parser(
        "presets",
        description="List the strategy catalogue: the presets usable with `hf-scale generate --preset NAME`, and which "
        "of them `hf-scale plan` tries (PLANNED: yes, or the degree it tries at each size; -: not planned).",
        epilog="example:\n  hf-scale presets\n  hf-scale generate --preset zero3_offload",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    presets.set_defaults(func=run_presets)

    schema = subparsers.add_parser(
        "schema",
        description="Print the JSON Schema of DistributedConfig, for editor completion and validation "
        "(e.g. a `# yaml-language-server: $schema=hf-scale.schema.json` line in your YAML).",
        epilog="example:\n  hf-scale schema > hf-scale.schema.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    schema.set_defaults(func=run_schema)


def _targets(text: str) -> tuple[str, ...]:
    targets = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [target for target in targets if target not in CHOSEN]
    if unknown or not targets:
        raise argparse.ArgumentTypeError(f"{text!r}: unknown target {unknown[0] if unknown else '(none)'!r}; "
                                         f"allowed: a comma-separated list of {', '.join(CHOSEN)}")
    return targets


PLAN_FLAG_FIELDS = {
    "num_machines": "topology.num_machines",
    "gpus_per_machine": "topology.processes_per_machine",
    "micro_batch_size": "batch.micro_batch_size",
    "precision": "precision",
    "activation_checkpointing": "activation_checkpointing",
}
"""The planning flags that are a field of the config: --strategy auto's plan writes their values there
(planner.rank.distributed_config); without it they are applied as `--set FIELD=VALUE` (tests/commands/test_generate.py
proves both give the same fields)."""


def _planning_flags(args: argparse.Namespace) -> tuple[argparse.Namespace, dict[str, object]]:
    """(``args`` with `hf-scale plan`'s defaults in place of the planning flags not typed, the typed ones)."""
    defaults = plan_defaults()
    typed = {dest: getattr(args, dest) for dest in defaults if getattr(args, dest) is not None}
    return argparse.Namespace(**{**vars(args), **defaults, **typed}), typed


def _flags_as_overrides(typed: dict[str, object]) -> list[str]:
    """Without --strategy auto: the typed planning flags as the `--set FIELD=VALUE` overrides they stand for, or a
    one-line UserError for a flag the config has no field for (only the planner uses it)."""
    names = plan_flag_names()
    for dest, value in typed.items():
        if dest not in PLAN_FLAG_FIELDS or value == "auto":
            shown = names[dest] if value is True else f"{names[dest]} {value}"
            raise UserError(f"{shown}: the config has no field for it, only the planner uses it: add --strategy auto "
                            "--model MODEL to plan the config, or set the config's fields with --set FIELD=VALUE")
    check_counts(typed)
    overrides = []
    for dest, value in typed.items():
        if dest == "precision":
            value = rules.precision_of(str(value), "--precision")
        elif dest == "activation_checkpointing":
            value = value == "on"
        overrides.append(f"{PLAN_FLAG_FIELDS[dest]}={json.dumps(value)}")  # JSON is YAML: "no" stays a string
    return overrides


def regenerate_command(args: argparse.Namespace, name: str, planned_name: str | None = None,
                       typed: dict[str, object] | None = None) -> str:
    """The command line that reproduces these files when run in the output directory (``typed``: the planning flags
    typed without --strategy auto)."""
    parts = ["hf-scale", "generate"]
    if args.config is not None:
        parts.append(args.config)
    if args.preset is not None:
        parts += ["--preset", args.preset]
    names = plan_flag_names()
    for dest, value in (typed or {}).items():
        parts += [names[dest], str(value)]
    for override in args.overrides:
        parts += ["--set", override]
    if args.strategy == "auto":
        parts += ["--strategy", "auto", "--model", args.model, *plan_argv(args)]
    if name != _default_name(args, planned_name):
        parts += ["--name", name]
    if args.deepspeed_mode != "auto":
        parts += ["--deepspeed-mode", args.deepspeed_mode]
    if args.recipe:
        parts.append("--recipe")
    if args.targets:
        parts += ["--targets", ",".join(args.targets)]
    parts += ["--output-dir", "."]
    return shlex.join(parts)


def _load(config: str | None, preset: str | None, overrides: list[str]) -> DistributedConfig:
    """The config of CONFIG.yaml or --preset NAME (or the defaults), with the --set overrides applied."""
    if config is not None and preset is not None:
        raise UserError(f"give a config file or --preset, not both (got {config} and --preset {preset})")
    return load_preset(preset, overrides) if preset is not None else load_config(config, overrides=overrides)


def _default_name(args: argparse.Namespace, planned_name: str | None = None) -> str | None:
    """The preset's name, the config file's stem, or the recommended candidate's (--strategy auto)."""
    if args.preset is not None:
        return args.preset
    if args.config is not None:
        return Path(args.config).stem
    return planned_name


def run_generate(args: argparse.Namespace) -> int:
    args.targets = tuple(dict.fromkeys(args.targets))  # every --targets given, each target once, in order
    planned_name, train_flags, plan = None, None, None
    args, typed = _planning_flags(args)
    overrides = args.overrides
    if args.strategy == "auto":
        typed = {}  # the plan's own flags: regenerate_command writes them after --strategy auto
        plan = _plan(args)
        planned_name, planned_data, train_flags = plan.recommended.slug, planned_config_data(plan, plan.recommended), \
            train_flags_of(plan)
    elif args.model is not None:
        raise UserError("--model is only used with --strategy auto (plan the config for that model)")
    elif args.config is None and args.preset is None:
        raise UserError(
            "give a CONFIG.yaml or --preset NAME (see `hf-scale presets`), or --strategy auto --model MODEL"
        )
    else:
        overrides = [*_flags_as_overrides(typed), *args.overrides]
    name = args.name if args.name is not None else _default_name(args, planned_name)
    problem = name_problem(name)
    if problem:
        # The default name is the config file's stem: say where the name came from.
        raise UserError(f"--name {name!r} {problem}" + ("" if args.name is not None else " (give --name NAME)"))
    if planned_name is not None:  # the planned config itself, the user's --set overrides on top
        cfg = config_from_data(planned_data, overrides)
        _refuse_heads(cfg, plan)
    else:
        cfg = _load(args.config, args.preset, overrides)
    header = f"{output_paths.GENERATED_HEADER}\n  {regenerate_command(args, name, planned_name, typed)}"
    needs_image = image_targets(args.targets)
    if needs_image and cfg.cluster.image is None:
        raise UserError(f"--targets {needs_image[0]} needs cluster.image: the image the pods run, with a version "
                        "tag, e.g. --set cluster.image=registry.example.com/team/hf-scale:0.1.0")
    _check_train_args(cfg, name)
    files = render_files(cfg, name=name, deepspeed_mode=args.deepspeed_mode, header=header, recipe=args.recipe,
                         targets=args.targets, train_flags=train_flags)
    changed = _plan_writes(Path(args.output_dir), files, force=args.force)
    for warning in config_warnings(cfg):
        print(f"hf-scale: warning: {warning}", file=sys.stderr)
    output_dir = Path(args.output_dir)
    executable = {rel_path for rel_path in changed if rel_path.endswith(_EXECUTABLE_SUFFIXES)}
    to_write = {rel_path: text for rel_path, text in files.items() if rel_path in changed}
    write_files_together(output_dir, to_write, executable=executable)
    for rel_path in files:
        print(f"{'wrote' if rel_path in changed else 'unchanged'} {output_dir / rel_path}")
    _print_summary(cfg, name)
    return 0


def _check_train_args(cfg: DistributedConfig, name: str) -> None:
    """cluster.train_args as train.py reads them on every node (hf_scale.check.train_flags: its parser, its value
    ranges, the config's fills): what train.py would refuse at start, after the job queued, is refused here. The
    manifests pass --output_dir (on the volume) and the generated hf_scale config themselves: a second one would
    win (argparse keeps the last) and put the checkpoints off the volume, or train another config."""
    train_args = cfg.cluster.train_args
    if not train_args:
        return
    from hf_scale.check.train_flags import against_config, parse_train_flags

    try:  # cluster.train_args alone: the node's own --output_dir before them changes nothing else
        flags = parse_train_flags(train_args, read_recipe=False)
    except UserError as error:
        raise UserError(f"cluster.train_args: {error} (train.py would refuse them on every node)") from None
    owned = {"output_dir": f"every node passes --output_dir {cfg.cluster.on_volume(name)} (cluster.output_dir/NAME, "
                           "on the output volume); a second one would put the checkpoints off it: change "
                           "cluster.output_dir or --name instead",
             "hf_scale_config": f"every node passes the generated hf_scale_configs/{name}.yaml; a second one would "
                                "train another config: change this config instead"}
    taken = sorted(flags.given & owned.keys())  # given in any spelling train.py takes
    if taken:
        raise UserError(f"cluster.train_args: --{taken[0]} is not allowed: {owned[taken[0]]}")
    problem = rules.restart_loop_problem(cfg.layout.sp, flags.namespace.loop) if "loop" in flags.given else None
    if problem:
        raise UserError(f"cluster.train_args: {problem}")
    contradictions = list(against_config(flags, cfg, "cluster.train_args").contradictions)
    if not contradictions:  # what the layout cannot run with: train.py's rule, before the process group
        from hf_scale.contract import parallel_refusals

        ns = flags.namespace
        refusal = parallel_refusals.flag_refusal(cfg.layout, packing=ns.packing,
                                                 attn_implementation=ns.attn_implementation, lora_r=ns.lora_r,
                                                 where="parallelism")
        contradictions += [f"cluster.train_args: {refusal}"] if refusal else []
    if contradictions:
        raise UserError("; ".join(contradictions) + " (train.py would stop on this on every node)")


def _plan(args: argparse.Namespace):
    """Plan --model: the plan, whose recommended candidate is the config (and its name, the default file name)."""
    if args.config is not None or args.preset is not None:
        raise UserError("--strategy auto plans the config itself: drop CONFIG.yaml/--preset (adjust it with --set)")
    if args.model is None:
        raise UserError("--strategy auto needs --model MODEL (a Hub id, a model directory or a config.json)")
    plan = plan_from_args(args, args.model)
    for line in verdict_lines(plan):
        print(line)
    if plan.recommended is None:
        raise NothingFits(f"--strategy auto: no strategy fits {args.model} on this hardware (see the reasons above); "
                          "nothing written")
    return plan


def _refuse_heads(cfg: DistributedConfig, plan) -> None:
    """The model is known: --set sizes that tp or sp cannot split its heads with, or an ep its experts rule out, are
    refused here, as train.py would before loading it (the planned sizes always divide them)."""
    from hf_scale.config.expert_parallel import experts_problem
    from hf_scale.config.parallelism import config_layout, head_problem

    shapes, layout = plan.workload.shapes, config_layout(cfg)
    problem = (head_problem(layout, shapes.num_attention_heads, shapes.num_key_value_heads)
               or experts_problem(layout.ep, shapes.model_type, shapes.num_experts, shapes.ep_plan))
    if problem:
        raise UserError(f"--set {problem} of {shapes.name}")


def _plan_writes(output_dir: Path, files: dict[str, str | bytes], *, force: bool) -> set[str]:
    """Check every target before anything is written; return the relative paths that need writing."""
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"--output-dir {output_dir} is not a directory")
    for parent in output_dir.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"--output-dir {output_dir}: {parent} is not a directory")
            break
    changed = set()
    for rel_path, text in files.items():
        path = output_dir / rel_path
        for parent in reversed(path.relative_to(output_dir).parents):
            if (output_dir / parent).exists() and not (output_dir / parent).is_dir():
                raise UserError(f"cannot write {path}: {output_dir / parent} exists and is not a directory")
        if path.is_dir():
            raise UserError(f"cannot write {path}: it is a directory")
        if not already_written(path, text, force=force, choose="another --name/--output-dir"):
            changed.add(rel_path)
    return changed


def _print_summary(cfg: DistributedConfig, name: str) -> None:
    topo = cfg.topology
    print(
        f"{name}: strategy={cfg.strategy} precision={cfg.precision} world_size={cfg.world_size} "
        f"({topo.num_machines} machine(s) x {topo.processes_per_machine} process(es)) "
        f"global_batch_size={cfg.batch.global_batch_size} micro_batch_size={cfg.batch.micro_batch_size} "
        f"gradient_accumulation_steps={cfg.batch.gradient_accumulation_steps}"
    )


def run_presets(args: argparse.Namespace) -> int:
    """Print the strategy catalogue: name, strategy, processes, whether and how `hf-scale plan` tries it, description
    (docs/config.md's table is tested against this output)."""
    from hf_scale.planner.parallel import SIZES

    rows = [("NAME", "STRATEGY", "PROCESSES", "PLANNED", "DESCRIPTION")]
    for preset in PRESETS.values():
        cfg = load_preset(preset.name)
        planned = "-" if preset.planned is None else "yes"
        if preset.planned is not None and preset.planned.vary:
            planned = f"{preset.planned.vary} {','.join(map(str, SIZES))}"
        rows.append((preset.name, cfg.strategy, str(cfg.world_size), planned, preset.description))
    widths = [max(len(row[column]) for row in rows) for column in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)) + "  " + row[4])
    return 0


def run_schema(args: argparse.Namespace) -> int:
    print(json.dumps(DistributedConfig.model_json_schema(), indent=2))
    return 0
