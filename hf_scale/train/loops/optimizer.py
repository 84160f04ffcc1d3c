"""The manual loop's optimizer and scheduler: the Trainer's choices, so both loops train identically."""

from __future__ import annotations

from accelerate.utils import DummyOptim, DummyScheduler
from transformers import Trainer, TrainingArguments, get_scheduler


def optimizer_and_scheduler(model, args: TrainingArguments, ds_config: dict | None, total_steps: int):
    """The Trainer's optimizer and scheduler choices, so both loops train identically.

    Mirrors transformers' `create_optimizer` / `deepspeed_optim_sched`: DeepSpeed's own optimizer when
    the JSON has an `optimizer` block (so optimizer offload runs its CPU Adam), otherwise --optim with weight
    decay off for biases and norms; DeepSpeed's scheduler when the JSON has a `scheduler` block, otherwise
    the torch scheduler of --lr_scheduler_type.
    """

    def make_scheduler(optimizer):
        return get_scheduler(
            args.lr_scheduler_type,
            optimizer=optimizer,
            num_warmup_steps=args.get_warmup_steps(total_steps),
            num_training_steps=total_steps,
            scheduler_specific_kwargs=args.lr_scheduler_kwargs,
        )

    # A `scheduler` block runs DeepSpeed's scheduler, as in the Trainer (a callable would win over it).
    ds_scheduler = ds_config is not None and "scheduler" in ds_config
    if ds_config is not None and "optimizer" in ds_config:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = DummyOptim(params, lr=args.learning_rate, weight_decay=args.weight_decay)
        callable_ = None if ds_scheduler else make_scheduler
        return optimizer, DummyScheduler(optimizer, lr_scheduler_callable=callable_)

    # get_decay_parameter_names does not use the Trainer instance; calling it unbound avoids building one.
    decay = set(Trainer.get_decay_parameter_names(None, model))
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if p.requires_grad and n in decay],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if p.requires_grad and n not in decay],
            "weight_decay": 0.0,
        },
    ]
    optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    optimizer = optimizer_cls([g for g in groups if g["params"]], **optimizer_kwargs)
    return optimizer, DummyScheduler(optimizer) if ds_scheduler else make_scheduler(optimizer)
