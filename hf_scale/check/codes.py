"""Every finding code of `hf-scale check`, as data: its severity, which inputs it is about (its family: the config
files, a --manifest, a --plan), the module that emits it and a one-line summary.

`hf-scale check --help` is written from this catalogue (:func:`help_listing`), a :class:`~hf_scale.check.findings.
Finding` with a code not in it cannot be built, and tests/check/test_check_report.py holds docs/check.md's tables to
it. Adding a code is one entry here (CONTRIBUTING.md, "Adding a check rule").
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from hf_scale.clusters import manifest_kinds_text

ERROR, WARNING = "error", "warning"
EITHER = "error or warning"
"""The severity of a code whose findings are errors or warnings depending on the case (e.g. a misspelled key is an
error, a foreign key a warning)."""


@dataclass(frozen=True)
class Family:
    """The inputs a group of codes is about, and the docs/check.md section whose table lists them."""

    name: str
    inputs: str
    """What `check --help` says before the family's codes."""
    anchor: str
    """The anchor of the docs/check.md heading above the family's table."""


FILES = Family("files", "the config files (accelerate YAML, DeepSpeed JSON, hf_scale config) and the training args",
               "what-it-checks")
MANIFEST = Family("manifest", f"with --manifest JOB.yaml ({manifest_kinds_text(how=False)})",
                  "job-manifests-from-other-projects")
PLAN = Family("plan", "with --plan PLAN.json (`hf-scale plan --json`) and --sbatch", "time-budgets-check---plan")
FAMILIES = (FILES, MANIFEST, PLAN)


@dataclass(frozen=True)
class Code:
    """One finding code."""

    code: str
    severity: str
    """ERROR, WARNING or EITHER."""
    family: Family
    module: str
    """The hf_scale.check module whose check emits it."""
    summary: str
    """One line for `check --help` (docs/check.md's row says more)."""


def _codes(family: Family, *rows: tuple[str, str, str, str]) -> list[Code]:
    return [Code(code, severity, family, module, summary) for code, severity, module, summary in rows]


# The files family in the order its checks run (hf_scale.check.checks.CHECKS), the order `check --help` lists them.
CATALOGUE: tuple[Code, ...] = (*_codes(
    FILES,
    ("unknown-accelerate-key", EITHER, "accelerate_yaml", "a YAML key accelerate refuses or copies and ignores"),
    ("accelerate-config-invalid", ERROR, "accelerate_yaml", "accelerate's loader refuses the YAML"),
    ("accelerate-launch-fails", ERROR, "accelerate_yaml", "`accelerate launch`'s own code fails on a YAML value"),
    ("fsdp2-option-ignored", WARNING, "accelerate_yaml", "an FSDP1-only option under `fsdp_version: 2`"),
    ("deepspeed-config-path", EITHER, "deepspeed_file", "`deepspeed_config_file` resolves from one directory only"),
    ("deepspeed-config-differs", EITHER, "deepspeed_file", "different places name different DeepSpeed JSON files"),
    ("deepspeed-config-unused", WARNING, "deepspeed_file", "a DeepSpeed JSON is given but DeepSpeed is never on"),
    ("ds-key-duplicated", ERROR, "deepspeed_file", "DeepSpeed keys in the YAML beside a DeepSpeed JSON file"),
    ("grad-accum-mismatch", EITHER, "batch", "gradient accumulation differs between YAML, JSON and training args"),
    ("micro-batch-mismatch", EITHER, "batch", "`train_micro_batch_size_per_gpu` vs --per_device_train_batch_size"),
    ("train-batch-mismatch", ERROR, "batch", "`train_batch_size` != micro batch x accumulation x world size"),
    ("train-batch-invalid", ERROR, "batch", "the batch size DeepSpeed derives is 0, not whole, or none is set"),
    ("precision-mismatch", EITHER, "precision", "mixed_precision, DeepSpeed fp16/bf16 and --bf16/--fp16 disagree"),
    ("fp16-and-bf16", ERROR, "precision", "fp16 and bf16 are both enabled"),
    ("fp8-key-unknown", EITHER, "fp8", "a key under `fp8_config` accelerate never reads"),
    ("fp8-value-invalid", ERROR, "fp8", "an fp8 value accelerate refuses when the processes start"),
    ("fp8-refused", ERROR, "fp8", "an fp8 combination accelerate refuses at start"),
    ("fp8-no-compile", WARNING, "fp8", "torchao fp8 without --torch_compile (usually slower than bf16)"),
    ("fp8-offload", WARNING, "fp8", "fp8 with offload (usually slower than bf16)"),
    ("fp8-small-layers", WARNING, "fp8", "fp8 on a model whose linear layers are all too small to convert"),
    ("qlora-no-lora", ERROR, "qlora", "--load_in_4bit without a LoRA rank"),
    ("qlora-fp8", ERROR, "qlora", "--load_in_4bit with fp8"),
    ("qlora-fsdp1", ERROR, "qlora", "--load_in_4bit under FSDP version 1"),
    ("auto-unresolvable", ERROR, "deepspeed_json", '"auto" values the chosen --runner cannot fill in'),
    ("hf-scale-config-mismatch", ERROR, "trainer_values", "a flag or the YAML contradicts --hf_scale_config"),
    ("ds-overrides-flags", EITHER, "trainer_values", "the JSON's optimizer/scheduler replace --optim/--lr_scheduler"),
    ("ds-trainer-mismatch", EITHER, "trainer_values", "a JSON value the Trainer compares with its flag differs"),
    ("deepspeed-key-removed", EITHER, "deepspeed_json", "a key a newer DeepSpeed removed"),
    ("deepspeed-warmup-refused", EITHER, "deepspeed_json", "a warmup scheduler with warmup_num_steps below 1"),
    ("unknown-deepspeed-key", EITHER, "deepspeed_json", "a key DeepSpeed refuses or never reads"),
    ("deepspeed-config-invalid", ERROR, "deepspeed_json", "DeepSpeed's parser refuses a value"),
    ("cpu-single-process", EITHER, "topology", "use_cpu (or --use_cpu) with more than one process"),
    ("use-cpu-ignores-plugin", ERROR, "topology", "use_cpu with FSDP or DeepSpeed (silently dropped)"),
    ("fsdp-no-gpu", WARNING, "topology", "FSDP on target machines without GPUs (--gpus-per-machine 0)"),
    ("fsdp-sharded-final-save", WARNING, "topology", "a sharded FSDP state dict: a plain Trainer saves no model"),
    ("processes-exceed-gpus", ERROR, "topology", "more processes per machine than --gpus-per-machine"),
    ("processes-implausible", ERROR, "topology", "num_processes or num_machines beyond any cluster"),
    ("offload-optimizer-swap", EITHER, "zero", "optimizer offload swaps the optimizer for DeepSpeed's CPU one"),
    ("nvme-without-path", ERROR, "zero", "offload to nvme without `nvme_path`"),
    ("zero3-no-16bit-save", WARNING, "zero", "ZeRO-3 without 16-bit weights gathered on save"),
    ("autotuning-enabled", ERROR, "zero", "`autotuning.enabled: true` exits the training partway"),
    ("zero-section-missing", ERROR, "zero", "a DeepSpeed JSON without `zero_optimization`"),
    ("multinode-no-main-ip", ERROR, "topology", "num_machines > 1 without main_process_ip"),
    ("processes-not-multiple-of-machines", ERROR, "topology", "num_processes is not a multiple of num_machines"),
    ("machine-rank-out-of-range", ERROR, "topology", "machine_rank outside 0..num_machines-1"),
    ("main-ip-invalid", ERROR, "topology", "main_process_ip is no address"),
    ("main-ip-placeholder", WARNING, "topology", "a placeholder main_process_ip in a multi-node YAML"),
    ("accelerate-value-invalid", ERROR, "accelerate_yaml", "a YAML value of the wrong type or out of range"),
    ("parallelism-key-unknown", EITHER, "parallelism", "a `parallelism_config` key accelerate has no option for"),
    ("parallelism-value-invalid", ERROR, "parallelism", "a parallelism size or backend setting accelerate refuses"),
    ("parallelism-size-mismatch", ERROR, "parallelism", "the parallelism sizes do not multiply to num_processes"),
    ("parallelism-unsupported", EITHER, "parallelism", "a parallelism layout the strategy, train.py or model refuses"),
    ("fsdp-setting-not-run", WARNING, "parallelism", "an fsdp_config value train.py does not run under tp > 1"),
    ("moe-accelerate-ep", ERROR, "moe", "an expert-parallel size in the YAML (accelerate has no such option)"),
    ("moe-deepspeed-autoep", WARNING, "moe", "the DeepSpeed JSON turns on DeepSpeed's AutoEP"),
    ("moe-ep-size", ERROR, "moe", "an AutoEP size DeepSpeed refuses when the processes start"),
    ("moe-ep-ignored", WARNING, "moe", "expert-parallel sizes in a section that is not enabled"),
    ("deepspeed-value-invalid", ERROR, "deepspeed_json", "a DeepSpeed JSON value of the wrong type or out of range"),
), *_codes(
    MANIFEST,
    ("manifest-invalid", ERROR, "cluster", "the engine's API models, schemas or webhooks refuse the job"),
    ("manifest-nodes", ERROR, "cluster", "the job's node count differs from the config's"),
    ("manifest-processes", ERROR, "cluster", "the job's processes per node differ from the config's"),
    ("manifest-gpus", ERROR, "cluster", "the job's GPUs per node differ from the processes per node"),
    ("manifest-image", EITHER, "cluster", "a missing or unpinned image"),
    ("manifest-output-volume", ERROR, "cluster", "--output_dir is not on a writable volume"),
    ("manifest-grace-period", EITHER, "cluster", "the grace period is shorter than a save (a warning without "
     "--checkpoint)"),
    ("manifest-deepspeed-batch", ERROR, "cluster", "train_batch_size does not fit the world size the job starts"),
    ("manifest-train-args", ERROR, "cluster", "train.py's parser refuses the arguments the job hands it"),
    ("manifest-not-hf-scale", WARNING, "cluster", "the job runs no hf_scale training"),
    ("manifest-not-read", WARNING, "report", "a document of the YAML stream that is no job"),
    ("manifest-restart-policy", ERROR, "cluster", "a restartPolicy that makes the preemption exit final"),
    ("manifest-secret", WARNING, "cluster", "a credential in plain text in the job's env"),
), *_codes(
    PLAN,
    ("grace-period-short", WARNING, "time_budget", "a --manifest's grace period is shorter than step + save"),
    ("signal-lead-short", WARNING, "time_budget", "an --sbatch's --signal lead is shorter than step + save"),
    ("collective-timeout-short", ERROR, "time_budget", "--ddp_timeout or DEEPSPEED_TIMEOUT shorter than step or save"),
))

CODES: dict[str, Code] = {entry.code: entry for entry in CATALOGUE}


def severity_problem(code: str, severity: str) -> str | None:
    """Why a finding of ``code`` with ``severity`` cannot exist (None when it can)."""
    entry = CODES.get(code)
    if entry is None:
        return f"finding code {code!r} is not in hf_scale.check.codes.CATALOGUE"
    if severity not in (ERROR, WARNING) or entry.severity not in (severity, EITHER):
        return f"finding code {code!r}: severity {severity!r}, the catalogue says {entry.severity!r}"
    return None


def help_listing(width: int = 100) -> str:
    """The finding codes of `check --help`: each family's inputs, then one line per code."""
    lines = []
    for family in FAMILIES:
        lines.append(f"  {family.inputs}:")
        for entry in CATALOGUE:
            if entry.family is family:
                severity = "" if entry.severity == ERROR else f" ({entry.severity})"
                lines += textwrap.wrap(f"{entry.code}{severity}: {entry.summary}", width - 4,
                                       initial_indent="    ", subsequent_indent="        ")
    return "\n".join(lines)
