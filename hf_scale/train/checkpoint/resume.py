"""What a resume trains: nothing when the checkpoint is the run's last step, and on this run's schedule.

**A finished run** (the checkpoint's step is the run's length) trains nothing: one line says so and train.py
exits 0, writing nothing (the transformers Trainer would train one step past `--max_steps` at learning rate 0 and
save checkpoint-(N+1)). A checkpoint past the run's length is refused in one line naming both (a shorter run
cannot be continued from it).

**Another length or schedule** (`--max_steps`, `--num_train_epochs`, `--learning_rate`, `--warmup_steps`,
`--lr_scheduler_type`, DeepSpeed's scheduler block): the run continues exactly on the schedule its flags give,
from the resumed step on: step N+1 trains at the learning rate a fresh run with these flags would use at step
N+1. That is the Trainer's own design (its schedule is rebuilt from the flags; only the scheduler's step count
comes from the checkpoint), made exact: loading the optimizer's state also restores the learning rate of the old
schedule's step N (0 at the end of a linear decay), which the first resumed step would otherwise train at,
silently, and a LambdaLR's loaded `base_lrs` would keep the old `--learning_rate` for the whole rest of the run.
The learning rate is set from this run's scheduler right after the load, in both loops, and said in one line
when it differs from the checkpoint's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hf_scale.contract import checkpoint_integrity, checkpoint_verification, launch_values
from hf_scale.errors import UserError
from hf_scale.train.checkpoint.save import REPORT_FILE
from hf_scale.train.setup import reconcile


def total_steps(run, train_rows: int) -> int:
    """The run's length in optimizer steps, as both loops count it (`run`: hf_scale.train.prepare.Run)."""
    if run.args.max_steps > 0:
        return run.args.max_steps
    values = reconcile.training_values(run.launch.flags, run.spec.world_size)
    return launch_values.planned_optimizer_steps(train_rows, values, run.args.num_train_epochs)


def _length(args, total: int) -> str:
    if args.max_steps > 0:
        return f"--max_steps={total}"
    return f"--num_train_epochs={args.num_train_epochs:g} ({total} steps)"


def finished(run, train_rows: int) -> bool:
    """True (said in one line by the main process) when the checkpoint resumed from is the run's last step; a
    one-line UserError when it is past it. Collective (the main process reads the checkpoint's step)."""
    resume_dir, args, state = run.resume_dir, run.args, run.state
    total = total_steps(run, train_rows)
    saved_step = checkpoint_verification.read_state(resume_dir)["step"] if state.is_main_process else None
    step = checkpoint_integrity.broadcast(state, saved_step)
    if step > total:
        raise UserError(
            f"{_length(args, total)}: --resume_from_checkpoint={resume_dir} is already at step {step}, past this "
            f"run's {total} steps; resume with a run of more than {step} steps, or start afresh in another --output_dir"
        )
    if step < total:
        return False
    if state.is_main_process:
        print(f"hf_scale: {resume_dir} is the last step ({step}) of this run ({_length(args, total)}): the run is "
              f"finished, nothing was trained or written; {_final_model(resume_dir, Path(args.output_dir))}",
              file=sys.stderr, flush=True)
    return True


def _final_model(resume_dir: Path, output_dir: Path) -> str:
    try:
        verified = json.loads((output_dir / REPORT_FILE).read_text()).get("ok") is True
    except (OSError, ValueError, AttributeError):
        verified = False
    if verified:
        return f"its final save is in {output_dir} (verified, {REPORT_FILE})"
    return (f"{output_dir} holds no verified final model: `hf-scale export {resume_dir} OUT` writes one from "
            "the checkpoint")


def continue_schedule(scheduler, learning_rate: float, *, announce: bool) -> None:
    """Right after a checkpoint is loaded: the next optimizer step's learning rate is this run's schedule at the
    resumed step (not the old schedule's, restored with the optimizer's state). `scheduler`: the loop's or the
    Trainer's (accelerate's wrappers are looked through); its own optimizer's groups are set, which are the ones
    the update reads (a DeepSpeed engine's too)."""
    import torch

    inner = scheduler
    while hasattr(inner, "scheduler"):  # accelerate's AcceleratedScheduler / DeepSpeedSchedulerWrapper
        inner = inner.scheduler
    if isinstance(inner, torch.optim.lr_scheduler.LambdaLR):  # every schedule of transformers' get_scheduler
        # Every param group of both loops starts at --learning_rate (Trainer.get_optimizer_cls_and_kwargs, the
        # DeepSpeed optimizer block's "auto"): a fresh run's base_lrs. The loaded ones are the old run's.
        inner.base_lrs = [learning_rate] * len(inner.base_lrs)
        # LambdaLR.get_lr's own expression at the resumed step: bit-identical to an uninterrupted run's.
        lrs = [base * fn(inner.last_epoch) for base, fn in zip(inner.base_lrs, inner.lr_lambdas, strict=True)]
    elif type(inner).__module__ == "deepspeed.runtime.lr_schedules":
        lrs = inner.get_lr()  # closed form of its step count and this run's config (e.g. total_num_steps)
    else:
        return  # ReduceLROnPlateau: no schedule over steps; the restored rate is the one to follow
    groups = inner.optimizer.param_groups
    restored = [group["lr"] for group in groups]
    for group, lr in zip(groups, lrs, strict=True):
        group["lr"] = lr
    inner._last_lr = list(lrs)  # what get_last_lr() reports until the next step
    if announce and restored != list(lrs):
        print(f"hf_scale: resumed on this run's learning-rate schedule: the next step trains at {lrs[0]:.6g} (the "
              f"checkpoint's run was at {restored[0]:.6g})", file=sys.stderr, flush=True)
