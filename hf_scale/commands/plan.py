"""`hf-scale plan MODEL ...`: per-GPU memory of every distributed strategy and the fastest that fits.

The same arguments drive ``hf-scale generate --strategy auto --model MODEL`` (:func:`add_plan_arguments`,
:func:`plan_from_args`), so both commands plan identically.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path

import yaml

from hf_scale.config.value_types import MAX_BATCH, MAX_MACHINES, MAX_PROCESSES_PER_MACHINE
from hf_scale.errors import UserError
from hf_scale.files.writing import already_written, check_output_file, write_text_atomically
from hf_scale.knowledge import rules
from hf_scale.planner.estimate import OPTIMIZER_STATE_BYTES, Workload
from hf_scale.planner.hardware import DEFAULT_GPU, Hardware, gpu_names, hardware, hardware_from_file
from hf_scale.planner.parallel import SIZES
from hf_scale.planner.rank import (
    DEFAULT_SAFETY_MARGIN,
    Plan,
    make_plan,
    planned_config_data,
    train_argv,
    with_qlora_fallback,
)
from hf_scale.planner.report import Budget, format_plan_table, plan_dict, plan_warnings, write_plot

_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
MAX_SEQ_LEN = 2**24
"""Tokens per sequence: 16M, far beyond any model's context."""
MAX_LORA_R = 2**16
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")

PLAN_EPILOG = """\
MODEL is a Hub id (only its config.json is fetched), a local model directory, or a path to a config.json.
Memory sizes take units B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024); an
"80 GB" H100/A100 has 80GiB.

examples:
  hf-scale plan meta-llama/Llama-3.1-8B --gpus-per-machine 8 --gpu-memory 80GiB --seq-len 4096
  hf-scale plan meta-llama/Llama-3.1-8B --gpu a100-80gb --seq-len 8192 --tokens 2e9 --price-per-gpu-hour 2.5
  hf-scale plan ./config.json --gpu-memory 24GiB --gpus-per-machine 4 --lora-r 16 --json
  hf-scale plan ./my-model --num-machines 2 --cpu-memory 1TiB --plot plan.png --write-config plan.yaml
  hf-scale plan meta-llama/Llama-3.1-8B --hardware my-node.yaml --calibrate runs/llama8b   # your node, your run
  hf-scale generate plan.yaml        # or both at once: hf-scale generate --strategy auto --model MODEL

exit codes: 0 a candidate fits (the recommendation), 1 no candidate fits (the table says why; no config is
written), 2 bad input (one line on stderr, nothing written).
"""
EXIT_NOTHING_FITS = 1


class NothingFits(UserError):
    """No candidate fits the hardware: exit 1 (not bad input, the answer is "no")."""

    exit_code = EXIT_NOTHING_FITS


def parse_size(flag: str, text: str) -> int:
    """'80GiB' -> bytes. A one-line UserError naming the flag for anything else."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).upper() if match else ""
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise UserError(
            f"{flag} {text!r} is invalid: expected a positive number with a unit, e.g. 80GiB or 80GB "
            "(units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def add_plan_arguments(parser: argparse.ArgumentParser, description: str | None = None) -> None:
    """Hardware and training flags shared by `plan` and `generate --strategy auto`."""
    group = parser.add_argument_group("planning", description)
    group.add_argument(
        "--gpus-per-machine", type=int, default=8, metavar="N",
        help="GPUs per machine (default 8); the plan runs one process per GPU: the config's "
        "topology.processes_per_machine",
    )
    group.add_argument(
        "--num-machines", "--machines", dest="num_machines", type=int, default=1, metavar="N",
        help="number of machines: the config's topology.num_machines (default 1)",
    )
    group.add_argument("--gpu", metavar="NAME", help=f"the GPU the times are predicted for, one of "
                       f"{', '.join(gpu_names())} (default {DEFAULT_GPU}); its memory unless --gpu-memory says so")
    group.add_argument("--gpu-memory", metavar="SIZE", help="memory of one GPU (default: the --gpu's, 80GiB for "
                       f"{DEFAULT_GPU})")
    group.add_argument(
        "--cpu-memory", metavar="SIZE", help="CPU RAM per machine, checked for offload (default: not checked)"
    )
    group.add_argument("--seq-len", type=int, default=4096, metavar="TOKENS", help="sequence length (default 4096)")
    group.add_argument("--micro-batch-size", "--micro-batch", dest="micro_batch_size", type=int, default=1, metavar="N",
                       help="sequences per GPU per forward pass: the config's batch.micro_batch_size, train.py's "
                       "--per_device_train_batch_size (default 1)")
    group.add_argument(
        "--precision", choices=rules.PRECISION_CHOICES, default="bf16", metavar="PRECISION",
        help="the config's precision: no | bf16 | fp16, or a dtype in either spelling (bfloat16 = bf16, float16 = "
        "fp16, fp32 = float32 = no); default bf16",
    )
    group.add_argument("--optimizer", choices=tuple(OPTIMIZER_STATE_BYTES), default="adamw", help="default adamw")
    group.add_argument("--lora-r", type=int, metavar="R", help="LoRA rank (frozen base); default: full fine-tune")
    group.add_argument("--load-in-4bit", action="store_true",
                       help="QLoRA: the frozen base in 4-bit NF4 (needs --lora-r). Without it, QLoRA is recommended "
                       "when neither the fine-tune asked for fits")
    group.add_argument(
        "--activation-checkpointing",
        choices=("auto", "on", "off"),
        default="auto",
        help="auto (default) considers both and prefers no checkpointing when it fits",
    )
    group.add_argument(
        "--safety-margin",
        type=float,
        default=DEFAULT_SAFETY_MARGIN,
        metavar="FRACTION",
        help=f"fraction of memory kept free for CUDA context, NCCL and fragmentation (default {DEFAULT_SAFETY_MARGIN})",
    )


@functools.cache
def _plan_actions() -> tuple[argparse.Action, ...]:
    """The planning flags' argparse actions (add_plan_arguments is their one definition)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_plan_arguments(parser)
    return tuple(parser._actions)


def plan_argv(args: argparse.Namespace) -> list[str]:
    """The planning flags of ``args`` that differ from their defaults, as command-line arguments."""
    argv: list[str] = []
    for action in _plan_actions():
        value = getattr(args, action.dest, action.default)
        if action.option_strings and value != action.default:
            argv += [action.option_strings[0], str(value)]
    return argv


def plan_defaults() -> dict[str, object]:
    """Each planning flag's destination -> its default (what `plan` and `generate --strategy auto` assume)."""
    return {action.dest: action.default for action in _plan_actions()}


def plan_flag_names() -> dict[str, str]:
    """Each planning flag's destination -> its spelling on the command line."""
    return {action.dest: action.option_strings[0] for action in _plan_actions() if action.option_strings}


_COUNT_BOUNDS = {"gpus_per_machine": MAX_PROCESSES_PER_MACHINE, "num_machines": MAX_MACHINES, "seq_len": MAX_SEQ_LEN,
                 "micro_batch_size": MAX_BATCH}


def check_counts(values: dict[str, object]) -> None:
    """The counting flags among ``values`` (destination -> value) in range, or a one-line UserError naming the flag."""
    names = plan_flag_names()
    for dest, bound in _COUNT_BOUNDS.items():
        value = values.get(dest)
        if value is not None and not 0 < value <= bound:
            raise UserError(f"{names[dest]} {value} is invalid: allowed an integer from 1 to {bound}")


def plan_from_args(args: argparse.Namespace, model: str) -> Plan:
    """Validate the flags (one-line UserError each) and plan."""
    check_counts(vars(args))
    if args.lora_r is not None and not 0 < args.lora_r <= MAX_LORA_R:
        raise UserError(
            f"--lora-r {args.lora_r} is invalid: allowed an integer from 1 to {MAX_LORA_R} (omit it for a full "
            "fine-tune)"
        )
    if args.load_in_4bit and args.lora_r is None:
        raise UserError("--load-in-4bit needs --lora-r R: a 4-bit base cannot be fully fine-tuned (QLoRA trains a "
                        "LoRA adapter on it)")
    if not 0 <= args.safety_margin < 1:
        raise UserError(f"--safety-margin {args.safety_margin} is invalid: allowed 0 <= fraction < 1, e.g. 0.1")
    gpu = plan_hardware(args)
    gpu_memory = gpu.memory_bytes if args.gpu_memory is None else parse_size("--gpu-memory", args.gpu_memory)
    cpu_memory = None if args.cpu_memory is None else parse_size("--cpu-memory", args.cpu_memory)
    from hf_scale.knowledge.model_shapes import model_shapes

    workload = Workload(
        shapes=model_shapes(model),
        gpus_per_machine=args.gpus_per_machine,
        num_machines=args.num_machines,
        seq_len=args.seq_len,
        micro_batch_size=args.micro_batch_size,
        precision=rules.precision_of(args.precision, "--precision"),
        optimizer=args.optimizer,
        lora_r=args.lora_r,
        load_in_4bit=args.load_in_4bit,
    )
    budget = {"gpu_memory": gpu_memory, "cpu_memory": cpu_memory, "gpu": gpu,
              "activation_checkpointing": args.activation_checkpointing, "safety_margin": args.safety_margin}
    plan = with_qlora_fallback(make_plan(workload, **budget), **budget)
    for warning in plan_warnings(plan):  # here, so that generate --strategy auto warns too
        print(f"hf-scale: warning: {warning}", file=sys.stderr)
    return plan


def plan_hardware(args: argparse.Namespace) -> Hardware:
    """The profile the times are predicted on: --hardware FILE, else --gpu NAME (both at once are refused), corrected
    by --calibrate RUN_DIR."""
    path = getattr(args, "hardware", None)  # plan's own flags; generate --strategy auto has neither
    if path is not None and args.gpu is not None:
        raise UserError(f"--gpu {args.gpu} and --hardware {path} are both given: choose one (the file describes the "
                        "GPU and its node)")
    gpu = hardware(args.gpu or DEFAULT_GPU) if path is None else hardware_from_file(path)
    run_dir = getattr(args, "calibrate", None)
    if run_dir is None:
        return gpu
    from hf_scale.planner.calibrate import calibrate

    calibration = calibrate(run_dir, gpu, gpus_per_machine=args.gpus_per_machine, optimizer=args.optimizer)
    args.calibration = calibration  # run_plan prints it (and --json carries it)
    return calibration.apply(gpu)


def planned_config_yaml(plan: Plan) -> str:
    """The recommended DistributedConfig as YAML (only the fields that differ from the defaults)."""
    if plan.recommended is None:
        raise UserError("no candidate fits, so there is no config to write: " + _refusal(plan))
    data = planned_config_data(plan, plan.recommended)
    w = plan.workload
    header = (f"# hf-scale plan: {plan.recommended.candidate.label} for {w.shapes.name} at --seq-len {w.seq_len}\n"
              "# The config has no field for the sequence length (nor LoRA): pass train.py these flags, or it trains\n"
              f"# at its own default length: {' '.join(train_argv(plan))}\n")
    return header + yaml.safe_dump(data, sort_keys=False)


def _refusal(plan: Plan) -> str:
    return "; ".join(f"{a.candidate.label}: {a.reason}" for a in plan.assessments[:3])


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the plan sub-command."""
    parser = subparsers.add_parser(
        "plan",
        description="Count the model's parameters exactly (meta device), estimate per-GPU memory of DDP, "
        "ZeRO-1/2/3 (with offload), FSDP2 (full shard; hybrid shard on several machines), FSDP2 x TP and FSDP2 x CP "
        f"(sizes {', '.join(map(str, SIZES))}; TP inside one machine and splitting whole heads; both with and "
        "without CPU offload) and, on several machines, HSDP x TP, each with and without activation checkpointing, "
        "and recommend the fastest candidate that fits.",
        epilog=PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "model", metavar="MODEL", help="model directory, config.json or Hub id (a path that exists wins; only the "
        "Hub repository's config.json is fetched, from the cache when it is there)"
    )
    add_plan_arguments(parser)
    measured = parser.add_argument_group("your own hardware")
    measured.add_argument("--calibrate", metavar="RUN_DIR", help="the output directory of a finished train.py run "
                          "on this hardware: its metrics.jsonl's measured step corrects every predicted step (the "
                          "factor that makes the plan predict that run's layout as measured)")
    measured.add_argument("--hardware", metavar="FILE", help="a GPU profile of your own node (YAML, the fields of one "
                          "entry of hf_scale/planner/data/hardware.yaml) in place of --gpu's (not with --gpu)")
    budget = parser.add_argument_group("time budget")
    budget.add_argument("--tokens", type=float, metavar="N", help="tokens to train: the plan adds each candidate's "
                        "wall-clock hours and GPU-hours")
    budget.add_argument("--price-per-gpu-hour", type=float, metavar="PRICE",
                        help="with --tokens: the cost of the run (in the price's currency)")
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    output.add_argument("--plot", metavar="PLAN.png", help="write a stacked-bar chart of every candidate")
    output.add_argument("--write-config", metavar="PLAN.yaml", help="write the recommended DistributedConfig")
    output.add_argument("--force", action="store_true",
                        help="replace an existing --write-config file whose content differs")
    parser.set_defaults(func=run_plan)


def check_budget(args: argparse.Namespace) -> None:
    """--tokens and --price-per-gpu-hour in range, or a one-line UserError."""
    if args.tokens is not None and not 1 <= args.tokens < float("inf"):
        raise UserError(f"--tokens {args.tokens:g} is invalid: allowed a positive number of tokens to train, e.g. 2e9")
    price = args.price_per_gpu_hour
    if price is not None and not (price >= 0 and price < float("inf")):
        raise UserError(f"--price-per-gpu-hour {price} is invalid: allowed a number >= 0")
    if price is not None and args.tokens is None:
        raise UserError(f"--price-per-gpu-hour {price} needs --tokens N: the cost is of training N tokens")


def run_plan(args: argparse.Namespace) -> int:
    check_budget(args)
    for flag, path in (("--plot", args.plot), ("--write-config", args.write_config)):
        if path is not None:
            check_output_file(Path(path), flag)
    plan = plan_from_args(args, args.model)
    budget = Budget(args.tokens, args.price_per_gpu_hour)
    # Everything that can fail is computed before any file is written.
    config_text = planned_config_yaml(plan) if args.write_config and plan.recommended is not None else None
    if config_text is not None:
        already_written(Path(args.write_config), config_text, flag="--write-config", force=args.force)
    if args.plot:
        write_plot(plan, Path(args.plot))
    if config_text is not None:
        write_text_atomically(Path(args.write_config), config_text)
    calibration = getattr(args, "calibration", None)
    if args.json:
        data = plan_dict(plan, budget)
        if calibration is not None:
            data["calibration"] = calibration.as_dict()
            print(calibration.describe(plan.hardware), file=sys.stderr)  # stdout stays one JSON document
        print(json.dumps(data, indent=2))
    else:
        if calibration is not None:
            print(calibration.describe(plan.hardware))
        print(format_plan_table(plan, budget), end="")
    written = sys.stderr if args.json else sys.stdout  # --json keeps stdout one JSON document
    if args.plot:
        print(f"wrote {args.plot} (memory per GPU of every candidate)", file=written)
    if config_text is not None:
        print(f"wrote {args.write_config} (turn it into launch files with: hf-scale generate {args.write_config})",
              file=written)
    if plan.recommended is None:
        if args.write_config:
            print(f"hf-scale plan: no candidate fits, so {args.write_config} was not written", file=sys.stderr)
        return EXIT_NOTHING_FITS
    return 0
