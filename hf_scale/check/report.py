"""The `hf-scale check` command: its parser (``register``), the handler (``run_check``) and the output (a table or
``--json``).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import textwrap
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hf_scale.check.checks import run_checks
from hf_scale.check.codes import help_listing
from hf_scale.check.findings import ERROR, TRAINING_ARGS, WARNING, Finding
from hf_scale.check.generated import regenerated_fixes
from hf_scale.check.inputs import RUNNERS, CheckInputs, load_inputs
from hf_scale.check.kinds import MANIFEST, WHAT_EACH_LOOKS_LIKE, kind_of, sort_files
from hf_scale.clusters import manifest_kinds_text
from hf_scale.errors import UserError


def summarize(inp: CheckInputs, findings: list[Finding]) -> dict[str, Any]:
    errors = sum(f.severity == ERROR for f in findings)
    files = [name for name in (inp.accelerate_file, inp.deepspeed_file, inp.hf_scale_config_file) if name]
    if inp.training is not None:
        files.append(TRAINING_ARGS)
    return {
        "errors": errors,
        "warnings": len(findings) - errors,
        "checked": files,
        "runner": inp.runner,
        "exit_code": 1 if errors else 0,
    }


def summary_line(summary: dict[str, Any]) -> str:
    counts = f"{summary['errors']} error(s), {summary['warnings']} warning(s)"
    verdict = "problems found" if summary["errors"] else ("ok with warnings" if summary["warnings"] else "ok")
    return f"{verdict}: {counts} in {', '.join(summary['checked'])} (runner: {summary['runner']})"


def _wrap_at_separators(text: str, width: int) -> list[str]:
    """Wrap a file:dotted.key after ``/``, ``:`` or ``.`` instead of in the middle of a name."""
    lines = [""]
    for token in re.split(r"(?<=[:./])", text):
        if lines[-1] and len(lines[-1]) + len(token) > width:
            lines.append("")
        lines[-1] += token
    return [piece[i : i + width] for piece in lines for i in range(0, len(piece), width)]


def format_findings_table(findings: list[Finding], width: int) -> str:
    """Columns severity | code | where | problem | fix; long cells wrap inside their column."""
    headers = ("SEVERITY", "CODE", "WHERE (FILE:KEY)", "PROBLEM", "FIX")
    rows = [(f.severity, f.code, f.where, f.problem, f.fix) for f in findings]
    fixed = [max([len(headers[i])] + [len(r[i]) for r in rows]) for i in (0, 1)]
    where = min(36, max([len(headers[2])] + [len(r[2]) for r in rows]))
    rest = max(40, width - sum(fixed) - where - 8)
    widths = [*fixed, where, rest // 2, rest - rest // 2]
    lines = []
    for row in [headers, *rows]:
        cells = [
            _wrap_at_separators(text, w) if column == 2 else textwrap.wrap(text, w, break_on_hyphens=False)
            for column, (text, w) in enumerate(zip(row, widths, strict=True))
        ]
        for n in range(max(map(len, cells))):
            parts = [
                (cell[n] if n < len(cell) else "").ljust(w) for cell, w in zip(cells, widths, strict=True)
            ]
            lines.append("  ".join(parts).rstrip())
        if row is headers:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _epilog() -> str:
    checks = help_listing()
    return f"""\
runners (which "auto" values in the DeepSpeed JSON get filled in):
  trainer      HF Trainer (default; also hf_scale's train.py with --loop accelerate)
  accelerate   a hand-written Accelerator loop: fills batch sizes, gradient_clipping,
               bucket sizes, DummyOptim lr/weight_decay, DummyScheduler values, fp16/bf16
  deepspeed    raw deepspeed.initialize: fills nothing

finding codes:
{checks}

exit codes: 0 no errors (warnings are printed but do not fail), 1 errors found,
            2 unreadable/invalid input

The DeepSpeed JSON is --deepspeed-config, else the YAML's deepspeed_config.deepspeed_config_file
(relative to the YAML's directory, then the current one), else --deepspeed in the training args.
A YAML with its DeepSpeed settings inline (no deepspeed_config_file) is checked as the config
accelerate's DeepSpeedPlugin builds from it, which is also what train.py trains with.
Training args after `--` are parsed by train.py's own parser: what train.py refuses (an abbreviation, an
unknown flag, a bad value) is bad input here too.
GPU findings need --gpus-per-machine N (GPUs per machine on the target); this machine's GPUs are never used.

examples:
  hf-scale check my.yaml                       (an accelerate YAML, a DeepSpeed JSON or an hf_scale config)
  hf-scale check accelerate_configs/zero3.yaml ds_configs/zero3.json \\
      -- --per_device_train_batch_size 4 --gradient_accumulation_steps 8 --bf16
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check",
        description="Read an existing accelerate YAML (and its DeepSpeed JSON and the training args) and "
        "report every inconsistency before a job starts: a table (or --json) of findings, each with a "
        "severity, a code, the file:key, the disagreeing values and the fix.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "files",
        nargs="*",
        metavar="FILE",
        help="the files to check, each recognized by its content: an accelerate config YAML, a DeepSpeed config JSON "
        "and/or an hf_scale config (read as train.py's --hf_scale_config); at most one of each. A train.py recipe "
        "is training args: give it after --",
    )
    parser.add_argument("--accelerate-config", metavar="A.yaml", help="accelerate config file (or give it as FILE)")
    parser.add_argument(
        "--deepspeed-config",
        metavar="D.json",
        help="DeepSpeed JSON (default: the one the YAML or --deepspeed in the training args names)",
    )
    parser.add_argument(
        "--runner",
        default="trainer",
        metavar="|".join(RUNNERS),
        help='what resolves "auto" in the DeepSpeed JSON (default: trainer)',
    )
    parser.add_argument(
        "--gpus-per-machine",
        "--gpus",
        dest="gpus_per_machine",
        type=int,
        metavar="N",
        help="GPUs per machine on the target cluster; enables the GPU findings (default: no assumption "
        "about GPUs; the machine running the check is never looked at)",
    )
    parser.add_argument(
        "--manifest",
        action="append",
        default=[],
        metavar="JOB.yaml",
        help=f"{manifest_kinds_text(how=False)} that runs this accelerate config (repeatable): nodes, "
        "processes and GPUs per node, image tag, output volume, grace period",
    )
    parser.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="a checkpoint of this run (OUTPUT_DIR/checkpoint-STEP): its save time is compared with the manifests' "
        "grace period",
    )
    parser.add_argument(
        "--plan",
        metavar="PLAN.json",
        help="the output of `hf-scale plan --json` for this run: its predicted step and save are compared with the "
        "manifests' grace period, the --sbatch files' --signal lead and the collective timeouts",
    )
    parser.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="FILE.sbatch",
        help="with --plan: an sbatch script whose #SBATCH --signal lead is compared with the predicted step + save",
    )
    parser.add_argument("--json", action="store_true", help="print {findings: [...], summary: {...}} as JSON")
    # train.py's arguments (TrainingArguments and train.py flags, or a recipe file) come after `--`:
    # hf_scale.commands.cli
    # hands them over as `passthrough` (FILE arguments and training arguments could not be told apart otherwise).
    parser.set_defaults(func=run_check, passthrough=[])


def _manifest_findings(manifests: list[str], checkpoint: str | None, inputs: CheckInputs,
                       accelerate_file: str | None) -> list[Finding]:
    """Each manifest against the configs given to check (the accelerate YAML, the hf_scale config) and those its
    command names (hf_scale.check.cluster)."""
    from hf_scale.check.cluster import accelerate_reference, check_manifest, hf_scale_reference, measured_save_seconds
    from hf_scale.files.reading import load_yaml_documents, read_text

    references = []
    if accelerate_file is not None:
        references.append(accelerate_reference(accelerate_file, inputs.accelerate))
    if inputs.hf_scale_config is not None:
        references.append(hf_scale_reference(str(inputs.hf_scale_config_file), inputs.hf_scale_config))
    given = tuple(str(f) for f in (accelerate_file, inputs.hf_scale_config_file, inputs.deepspeed_file) if f)
    hf_scale = (str(inputs.hf_scale_config_file), inputs.hf_scale_config) if inputs.hf_scale_config else None
    save = measured_save_seconds(Path(checkpoint)) if checkpoint else None
    findings: list[Finding] = []
    for path in manifests:
        documents = load_yaml_documents(read_text(Path(path), "--manifest"), f"--manifest {path}")
        for data in manifest_documents(path, documents, findings):
            findings += check_manifest(path, data, references, save_seconds=save, deepspeed=inputs.deepspeed,
                                       given_files=given, hf_scale_config=hf_scale)
    return findings


def manifest_documents(path: str, documents: list, findings: list[Finding]) -> list:
    """The documents of a manifest file that check reads (TrainJob, PyTorchJob, SkyPilot task); each other document
    of a stream (a TrainingRuntime beside its TrainJob, a SkyPilot job group's header) is one `manifest-not-read`
    warning added to ``findings``. A single document is returned as it is (check_manifest says what it is not)."""
    if len(documents) <= 1:
        return documents or [None]
    known = [data for data in documents if kind_of(data) == MANIFEST]
    if not known:
        raise UserError(f"--manifest {path}: none of its {len(documents)} YAML documents is "
                        f"{manifest_kinds_text()}")
    for number, data in enumerate(documents, 1):
        if kind_of(data) != MANIFEST:
            what = data.get("kind", "a mapping of no kind") if isinstance(data, dict) else type(data).__name__
            findings.append(Finding(WARNING, "manifest-not-read", path, f"document {number}",
                                    f"document {number} of {len(documents)} is {what}: check does not read it (it "
                                    f"reads {manifest_kinds_text(how=False)})",
                                    f"nothing to do; check the other files {Path(path).name}'s jobs use by giving "
                                    "them to check"))
    return known


def run_check(args: argparse.Namespace) -> int:
    if args.gpus_per_machine is not None and args.gpus_per_machine < 0:
        raise UserError(
            f"--gpus-per-machine {args.gpus_per_machine}: must be >= 0 (GPUs per machine on the target)"
        )
    files = sort_files(args.files, args.accelerate_config, args.deepspeed_config)
    training = list(args.passthrough)
    nothing = files.accelerate is None and files.deepspeed is None and files.hf_scale is None and not training
    if nothing and not (args.manifest or files.manifests):
        raise UserError(f"check: no file to check: give {WHAT_EACH_LOOKS_LIKE} (hf-scale check FILE... [-- "
                        "TRAINING-ARGS])")
    inputs = load_inputs(
        files.accelerate,
        files.deepspeed,
        training,
        args.runner,
        gpus_per_machine=args.gpus_per_machine,
        hf_scale_file=files.hf_scale,
    )
    manifests = [*args.manifest, *files.manifests]
    if args.sbatch and not args.plan:
        raise UserError(f"--sbatch {args.sbatch[0]}: only with --plan PLAN.json (its predicted step and save are what "
                        "the --signal lead is compared with)")
    timed = []
    if args.plan:
        from hf_scale.check.time_budget import check_time_budget, manifest_budgets

        timed = list(check_time_budget(args.plan, inputs, manifests=manifest_budgets(manifests),
                                        sbatches=args.sbatch))
    findings = regenerated_fixes(run_checks(inputs) + _manifest_findings(manifests, args.checkpoint, inputs,
                                                                         files.accelerate) + timed)
    summary = summarize(inputs, findings)
    summary["checked"] += manifests
    if args.json:
        payload = {"findings": [{**asdict(f), "where": f.where} for f in findings], "summary": summary}
        print(json.dumps(payload, indent=2, default=str))
    else:
        if findings:
            print(format_findings_table(findings, shutil.get_terminal_size((150, 24)).columns))
            print()
        print(summary_line(summary))
    return summary["exit_code"]
