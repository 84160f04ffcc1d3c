"""What train.py may do to OUTPUT_DIR: only what hf_scale wrote is ever removed or replaced.

At startup, under the output_dir lock and before anything in it is touched: a temporary directory named like
hf_scale's (`.tmp-checkpoint-*`) without hf_scale's marker, or files the run would replace (a model's
config.json and safetensors, tokenizer files, metrics.jsonl, ...) in a directory hf_scale has not marked as its
own, are the user's: one line naming them, exit 2, unless `--overwrite_output_dir` (then such temporaries are
removed and such files replaced). hf_scale marks OUTPUT_DIR (`checkpoint_layout.MARKER`) just before a run
writes its first file there (metrics.jsonl, once the model is loaded and checked), so a run that stops
earlier leaves the directory as it was.
"""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

from hf_scale.contract import checkpoint_integrity, checkpoint_layout
from hf_scale.errors import UserError
from hf_scale.files import hub
from hf_scale.train.checkpoint import output_lock, reshard, store
from hf_scale.train.checkpoint.save import REPORT_FILE

RUN_FILES = (checkpoint_layout.MODEL_CONFIG, "generation_config.json", "*.safetensors", "*.safetensors.index.json",
             checkpoint_layout.ADAPTER_CONFIG, "pytorch_model*.bin", "tokenizer*", "special_tokens_map.json",
             "added_tokens.json", "chat_template.jinja", "vocab.*", "merges.txt", "training_args.bin", "README.md",
             "metrics.jsonl", "train_summary.json", REPORT_FILE, checkpoint_layout.LIVE_FILE)
"""What a run may write into OUTPUT_DIR itself, replacing a file of that name: the final model (transformers'
save_pretrained, the tokenizer's files, peft's README.md model card, the Trainer's training_args.bin) and
hf_scale's own records."""


def foreign(output_dir: str | Path) -> list[str]:
    """The entries of `output_dir` a run would remove or replace that hf_scale did not write (marked)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [p.name for p in store.temporary_dirs(root) if not checkpoint_layout.is_removable_temporary(p)]
    if not checkpoint_layout.is_ours(root):
        found += sorted(p.name for p in root.iterdir()
                        if any(fnmatch.fnmatchcase(p.name, pattern) for pattern in RUN_FILES))
    return found


def _refusal(output_dir: str, names: list[str]) -> str:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (f"--output_dir={output_dir}: holds {shown}, not written by hf_scale (no {checkpoint_layout.MARKER}), "
            "which this run would replace or remove; choose another --output_dir, move them away, or pass "
            "--overwrite_output_dir to let this run replace them")


def claim(args, spec, state, hub_target, *, overwrite: bool) -> Path | None:
    """One run per output_dir, locked before anything in it is touched; what the run would replace or remove
    checked to be hf_scale's; hf_scale's own interrupted saves removed; the checkpoint to resume from (`auto`:
    the newest that verifies). Collective: a refusal is the same line on every rank."""
    output_lock.acquire(args.output_dir, state)
    refusal = None
    if state.is_main_process:
        names = foreign(args.output_dir)
        refusal = _refusal(args.output_dir, names) if names and not overwrite else None
    refusal = checkpoint_integrity.broadcast(state, refusal)
    if refusal:
        raise UserError(refusal)
    if state.is_main_process:
        for path in store.remove_interrupted(args.output_dir, foreign_too=overwrite):
            print(f"hf_scale: removed interrupted save {path}", file=sys.stderr)
        if hub_target is not None:  # as the Trainer does: a refused token stops the run before training
            hub.create_repo(hub_target, "--push_to_hub")
    state.wait_for_everyone()
    resume_dir = store.resolve_resume(args.resume_from_checkpoint, args.output_dir, state)
    if resume_dir is not None:  # refuse what cannot resume (reshard.check_resumable)
        reshard.check_resumable(resume_dir, spec)
        if state.is_main_process:
            print(f"hf_scale: resuming from {resume_dir}", file=sys.stderr)
    return resume_dir


def mark(output_dir: str | Path, state) -> None:
    """Before the run's first file in OUTPUT_DIR: the directory's files are hf_scale's to replace from now on."""
    if state.is_main_process:
        marker = Path(output_dir) / checkpoint_layout.MARKER
        if not marker.is_file():
            marker.write_text("hf_scale writes this run directory: it replaces its own files here (the final model, "
                              "metrics.jsonl) and removes only its own temporary directories\n")
