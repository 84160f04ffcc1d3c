"""Which `TrainingArguments` flags the manual loop (`--loop accelerate`) applies; the rest it refuses.

train.py parses every TrainingArguments flag in both loops (HfArgumentParser), but only the HF Trainer reads
all of them. A flag the manual loop does not apply would be ignored in silence, so `--loop accelerate` refuses
it, in one line before anything is launched or loaded, when it is given (command line or recipe) with a value
other than its default: ``--NAME=VALUE: applied only by --loop trainer; use --loop trainer or drop the flag``.

The one table, :data:`APPLIED`, was built by reading the manual loop's code path (hf_scale.train.main's
stages, loop, evaluation, metrics, checkpoint, data, model, liger, run_spec, distributed, hub).
tests/train/setup/test_loop_flags.py keeps it true: every field it names is read on that path (or by the transformers
function it names, which that path calls), and every TrainingArguments field read on that path is in it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hf_scale.errors import UserError


@dataclass(frozen=True)
class Applied:
    """A TrainingArguments field the manual loop applies."""

    why: str
    via: str | None = None
    """The transformers callable that reads the field, which the manual loop's path calls (None: hf_scale's
    own code reads it)."""
    unsupported: tuple[str, ...] = ()
    """Values of the field the manual loop does not apply (refused like an unapplied flag)."""
    unsupported_prefixes: tuple[str, ...] = ()


_OPTIMIZER = "Trainer.get_optimizer_cls_and_kwargs"
_POST_INIT = "TrainingArguments.__post_init__"

APPLIED: dict[str, Applied] = {
    # Where the run writes, and the run's length and batch (the run spec, hf_scale.train.setup.run_spec).
    "output_dir": Applied("the lock, metrics.jsonl, the checkpoints and the final model"),
    "per_device_train_batch_size": Applied("the run spec's micro batch: the loader's batch size"),
    "gradient_accumulation_steps": Applied("the run spec: micro-batches per optimizer step"),
    "num_train_epochs": Applied("the run's length when --max_steps is not set"),
    "max_steps": Applied("the run's length"),
    "seed": Applied("set_seed before the model is built; the data order unless --data_seed"),
    "data_seed": Applied("the sampler's seed (accelerate's seedable sampler)"),
    "resume_from_checkpoint": Applied("accelerate's load_state (any world size)"),
    # Precision and the engines, as the launcher and --hf_scale_config reconcile them.
    "bf16": Applied("the run spec's precision: accelerate's mixed_precision"),
    "fp16": Applied("the run spec's precision: accelerate's mixed_precision"),
    "tf32": Applied("TrainingArguments switches torch's TF32 matmuls for the process, before either loop",
                    via=_POST_INIT),
    "deepspeed": Applied("TrainingArguments' DeepSpeed plugin, handed to the Accelerator"),
    "ddp_backend": Applied("the process group (hf_scale.train.setup.distributed)"),
    "ddp_timeout": Applied("the process group's collective timeout"),
    "ddp_find_unused_parameters": Applied("accelerate's DDP wrapper (loop.ddp_kwargs_handlers)"),
    "ddp_bucket_cap_mb": Applied("accelerate's DDP wrapper (loop.ddp_kwargs_handlers)"),
    "ddp_broadcast_buffers": Applied("accelerate's DDP wrapper (loop.ddp_kwargs_handlers)"),
    "ddp_static_graph": Applied("accelerate's DDP wrapper (loop.ddp_kwargs_handlers)"),
    "activation_checkpointing": Applied("TrainingArguments copies it to gradient_checkpointing",
                                        via=_POST_INIT),
    "gradient_checkpointing": Applied("the model's own checkpointing (non-reentrant), before wrapping"),
    "torch_compile": Applied("accelerate's TorchDynamoPlugin"),
    "torch_compile_backend": Applied("accelerate's TorchDynamoPlugin"),
    "torch_compile_mode": Applied("accelerate's TorchDynamoPlugin"),
    "use_liger_kernel": Applied("transformers' apply_liger_kernel, as the Trainer calls it"),
    "liger_kernel_config": Applied("transformers' apply_liger_kernel"),
    # The optimizer and scheduler: the Trainer's own functions.
    "optim": Applied(
        "the Trainer's optimizer class", via=_OPTIMIZER,
        # These need more than a class and its arguments (parameter groups per target module, a fused
        # backward, optimizer.train()/eval() around evaluation), which only the Trainer's training step does.
        unsupported_prefixes=("galore", "apollo", "lomo", "adalomo", "schedule_free"),
    ),
    "optim_args": Applied("the optimizer's extra arguments", via=_OPTIMIZER),
    "learning_rate": Applied("the optimizer's lr"),
    "weight_decay": Applied("the decayed parameter group (not biases and norms), as in the Trainer"),
    "adam_beta1": Applied("the optimizer's betas", via=_OPTIMIZER),
    "adam_beta2": Applied("the optimizer's betas", via=_OPTIMIZER),
    "adam_epsilon": Applied("the optimizer's eps", via=_OPTIMIZER),
    "max_grad_norm": Applied("clipping (DeepSpeed clips inside its step)"),
    "lr_scheduler_type": Applied(
        "transformers' get_scheduler",
        # They step on an eval metric, which the manual loop does not hand to the scheduler.
        unsupported=("reduce_lr_on_plateau", "greedy"),
    ),
    "lr_scheduler_kwargs": Applied("transformers' get_scheduler"),
    "warmup_steps": Applied("the scheduler's warmup", via="TrainingArguments.get_warmup_steps"),
    # The loader.
    "dataloader_num_workers": Applied("the train and eval loaders"),
    "dataloader_pin_memory": Applied("the train loader (on a GPU)"),
    "dataloader_persistent_workers": Applied("the train loader"),
    "dataloader_prefetch_factor": Applied("the train loader"),
    # Evaluation (hf_scale.train.loops.evaluation, the same in both loops).
    "eval_strategy": Applied("the eval schedule"),
    "eval_steps": Applied("the eval schedule"),
    "eval_on_start": Applied("the eval schedule"),
    "do_eval": Applied("an evaluation at the end"),
    "per_device_eval_batch_size": Applied("the eval micro-batch"),
    "logging_steps": Applied("the eval interval when --eval_steps is not set (TrainingArguments' rule); "
                             "metrics.jsonl and the --report_to trackers get every step in this loop"),
    # Logging, saving, the Hub.
    "report_to": Applied("accelerate's trackers"),
    "disable_tqdm": Applied("the progress bars"),
    "save_strategy": Applied("checkpoints every --save_steps", unsupported=("epoch", "best")),
    "save_steps": Applied("the checkpoint interval"),
    "save_total_limit": Applied("checkpoint rotation"),
    "push_to_hub": Applied("hf_scale pushes once after the save check, in both loops"),
    "hub_model_id": Applied("the Hub repository"),
    "hub_token": Applied("the Hub token"),
    "hub_private_repo": Applied("the Hub repository's visibility"),
    "hub_revision": Applied("the Hub branch"),
}
"""Field name -> why the manual loop applies it."""

NO_EFFECT: dict[str, str] = {
    "do_train": "train.py always trains, in both loops",
    "local_rank": "set by the deepspeed launcher; the process group comes from the environment in both loops",
    # hf_scale's evaluation (both loops) sums the token losses only: no predictions gathered, no
    # compute_metrics, so these settings of the Trainer's prediction loop have nothing to act on.
    "prediction_loss_only": "hf_scale's evaluation computes the loss only, in both loops",
    "eval_accumulation_steps": "hf_scale's evaluation gathers no predictions to offload, in both loops",
    "eval_do_concat_batches": "hf_scale's evaluation gathers no predictions, in both loops",
    "eval_use_gather_object": "hf_scale's evaluation gathers no predictions, in both loops",
    "include_for_metrics": "train.py takes no compute_metrics, in both loops",
    "batch_eval_metrics": "train.py takes no compute_metrics, in both loops",
    # What the non-default value asks for is what this loop does anyway.
    "logging_first_step": "the manual loop logs every step, the first included",
    "logging_nan_inf_filter": "the manual loop logs every loss unfiltered (what false asks for)",
    "log_on_each_node": "the manual loop logs on the main process only (what false asks for)",
    "skip_memory_metrics": "the manual loop records peak memory at every step (metrics.jsonl)",
    "remove_unused_columns": "train.py's datasets hold only the model's columns: nothing to remove",
}
"""Fields accepted under `--loop accelerate` although it reads none of them: why that changes nothing."""

IN_NEITHER_LOOP: dict[str, str] = {
    "hub_strategy": "hf_scale pushes once, at the end, after the save check",
    "hub_always_push": "hf_scale pushes once, at the end, after the save check",
    "accelerator_config": "train.py sets its own (the Trainer reuses train.py's process group)",
    "bf16_full_eval": "hf_scale's evaluation runs in the training precision",
    "fp16_full_eval": "hf_scale's evaluation runs in the training precision",
    "do_predict": "train.py has no prediction stage",
}
"""Fields hf_scale applies in neither loop (the Trainer path replaces what reads them): why. Refused with that
reason under either loop."""


def _text(value) -> str:
    value = getattr(value, "value", value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def refusal(ns, defaults: dict, fields) -> str | None:
    """The one-line refusal for the first unapplied flag given (or value the loop does not apply), or None.

    ``ns``: train.py's parsed flags; ``defaults``: each flag's parser default; ``fields``: the names of
    TrainingArguments' fields (of the installed transformers)."""
    for name in fields:
        if name in NO_EFFECT or not hasattr(ns, name):
            continue
        value = getattr(ns, name)
        if value == defaults.get(name) or _text(value) == _text(defaults.get(name)):
            continue
        if name in IN_NEITHER_LOOP:
            return f"--{name}={_text(value)}: not applied in either loop ({IN_NEITHER_LOOP[name]}); drop the flag"
        if ns.loop != "accelerate":
            continue
        applied = APPLIED.get(name)
        if applied is None:
            return f"--{name}={_text(value)}: applied only by --loop trainer; use --loop trainer or drop the flag"
        text = _text(value)
        if text in applied.unsupported or text.startswith(applied.unsupported_prefixes):
            return (f"--{name}={text}: this value is applied only by --loop trainer; use --loop trainer or another "
                    "value")
    return None


def check(ns, parser) -> None:
    """Refuse (UserError) a flag `--loop accelerate` would ignore; ``parser``: train.py's, for the defaults."""
    from transformers import TrainingArguments

    fields = [f.name for f in dataclasses.fields(TrainingArguments) if f.init]
    # The defaults as parsing gives them (argparse converts a string default with the flag's type).
    problem = refusal(ns, vars(parser.parse_known_args([])[0]), fields)
    if problem:
        raise UserError(problem)
