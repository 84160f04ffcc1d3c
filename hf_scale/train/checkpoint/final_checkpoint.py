"""The final save of a ZeRO-3 run without 16-bit gathering: the final step's checkpoint, not a safetensors model.

`stage3_gather_16bit_weights_on_model_save: false` (hf_scale config: `deepspeed.gather_16bit_weights_on_save=false`)
is a choice: at 70B, gathering 140 GB of 16-bit weights onto the main process at the end is what the user wants to
avoid; they keep the sharded checkpoint and convert it offline. The run then ends with a complete hf_scale
checkpoint of its final step, written by the loop's own checkpoint writer (sealed with its manifest and checksums,
rotated by --save_total_limit; the one saved at that step is reused, never written twice), and
`hf_scale_verify.json` says so. Its proof is the resume's: every file of the manifest re-read (size, checksum) and
the small state files loaded (hf_scale.contract.checkpoint_verification.verify). `hf-scale export` turns it into
safetensors.

This is what the transformers Trainer does in `save_model` when gathering is off (it saves the DeepSpeed
checkpoint and says to use zero_to_fp32.py), but as a checkpoint that `--resume_from_checkpoint` and
`hf-scale export` read, and with the command to run printed.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path

from hf_scale.contract import checkpoint_layout, checkpoint_verification
from hf_scale.errors import UserError
from hf_scale.knowledge import rules
from hf_scale.train.checkpoint import store
from hf_scale.train.checkpoint.save import REPORT_FILE

WHAT = "checkpoint"
"""`what` of the report (the safetensors check's reports say `model` or `LoRA adapter`)."""
WHY = "ZeRO-3 without 16-bit gathering on save (stage3_gather_16bit_weights_on_model_save false)"
EXPORTED_NAME = "model"
"""Where the printed `hf-scale export` command puts the safetensors: OUTPUT_DIR/model."""


def startup_notice(output_dir: str) -> str:
    """The line the main process prints at the start, so that nobody is surprised after a 10-hour run."""
    return (f"{WHY}: the final model will be the last step's DeepSpeed checkpoint "
            f"{checkpoint_layout.checkpoint_dir(output_dir, 'STEP')}, not safetensors; `hf-scale export` turns it "
            "into safetensors after the run (set stage3_gather_16bit_weights_on_model_save true to save "
            "safetensors at the end instead)")


def refuse_push(ds_config: dict | None, repo_id: str, output_dir: str) -> None:
    """--push_to_hub has no model to push when the run ends with a checkpoint: one line, before anything loads."""
    if rules.zero3_without_gathering(ds_config):
        raise UserError(
            f"--push_to_hub {repo_id}: {WHY} in the DeepSpeed config ends the run with a DeepSpeed checkpoint, not a "
            "model to push; set stage3_gather_16bit_weights_on_model_save true (hf_scale config: "
            "deepspeed.gather_16bit_weights_on_save=true), or drop --push_to_hub and push after the run with "
            f"`hf-scale export {checkpoint_layout.checkpoint_dir(output_dir, 'STEP')} OUT --push-to-hub {repo_id}`"
        )


def export_command(checkpoint_dir: Path, output_dir: str, precision: str) -> str:
    """The exact command that turns the checkpoint into safetensors (in the 16-bit dtype a gathered save would
    have written, for a bf16/fp16 run)."""
    words = ["hf-scale", "export", os.path.abspath(checkpoint_dir), os.path.abspath(Path(output_dir, EXPORTED_NAME))]
    if precision in ("bf16", "fp16"):
        words += ["--dtype", precision]
    return shlex.join(words)


def verify(path: Path, state, *, output_dir: str, precision: str) -> dict | None:
    """Prove the final checkpoint `path` (OUTPUT_DIR/checkpoint-STEP) complete: manifest, sizes and every checksum
    (each rank hashes a share), state files loadable, model weights present. A collective: every rank calls it.
    The main process writes REPORT_FILE into `output_dir` and returns the report; the other ranks return None."""
    started = time.perf_counter()
    step = checkpoint_layout.step_of(path)
    found = checkpoint_verification.verify(path, state)
    if not state.is_main_process:
        return None
    layout = checkpoint_layout.detect_layout(path)
    entries, _ = checkpoint_layout.read_manifest(path)
    found = found or _content_problem(path, layout, step)
    report = {
        "ok": found is None,
        "what": WHAT,
        "why": f"{WHY}: the final step is saved as a checkpoint, not as safetensors",
        "checkpoint": os.path.abspath(path),
        "step": step,
        "weights": layout.weights,
        "deepspeed_tag": layout.deepspeed_tag,
        "files_checked": len(entries or {}),
        "bytes_checked": sum(entry["size"] for entry in (entries or {}).values()),
        "seconds": round(time.perf_counter() - started, 3),
        "comparison": f"every file of {checkpoint_layout.MANIFEST} re-read (size and checksum) and the state files "
                      "loaded, as --resume_from_checkpoint does",
        "export_command": export_command(path, output_dir, precision),
        "problems": {"checkpoint": [found]} if found else {},
    }
    Path(output_dir, REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _content_problem(path: Path, layout: checkpoint_layout.Layout, step: int) -> str | None:
    """What makes a checkpoint whose files verify still not the run's final model, or None."""
    if layout.weights is None:
        return f"no model weights in it ({layout.describe()})"
    try:
        saved_step = checkpoint_verification.read_state(path)["step"]
    except UserError as error:
        return str(error)
    return None if saved_step == step else f"{checkpoint_layout.STATE} records step {saved_step}, not {step}"


def is_report(report: dict) -> bool:
    return report.get("what") == WHAT


def summary_entry(report: dict) -> dict:
    """What train_summary.json records about the final save."""
    keys = ("what", "checkpoint", "step", "weights", "export_command")
    return {"verified": report["ok"], **{key: report[key] for key in keys}}


def saved_clause(report: dict) -> str:
    """The end of the run's last line: the checkpoint, and the command that makes safetensors of it."""
    if not report["ok"]:
        return f"final step saved as the checkpoint {report['checkpoint']}, but the check FAILED"
    return (f"final step saved as the DeepSpeed checkpoint {report['checkpoint']} (ZeRO-3 without 16-bit gathering: "
            f"no safetensors), verified ({report['files_checked']} files, {report['seconds']:.1f} s); safetensors "
            f"with: {report['export_command']}")


def failure_message(report: dict, output_dir: str) -> str:
    """The one-line error for a report that is not ok."""
    return (f"the final checkpoint {report['checkpoint']} does not verify: {report['problems']['checkpoint'][0]}; "
            f"{store.intact_note(output_dir)}")
