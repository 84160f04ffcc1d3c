"""Evaluation on the validation set, the same in both loops and under every strategy.

The eval loss is the exact token-weighted mean over the whole validation set on all ranks — the
normalisation of training (target tokens `labels[..., 1:] != -100`, summed per micro-batch, all-reduced
once) — so it does not depend on the number of processes, the eval micro-batch size or padding.
Perplexity is exp(eval loss).

The validation set is cut, in order, into micro-batches of --per_device_eval_batch_size, dealt
round-robin to the ranks. Under ZeRO-3 and FSDP every forward is a collective (parameters are
gathered), so every rank must run the same number of them: a rank short of a micro-batch at the tail
runs one more on a copy of the first and counts nothing from it. (accelerate's `even_batches` pads the
same way but then only per-sample gathers can drop the copies, not token sums; hence this sampler.)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from hf_scale.config.parallelism import Layout
from hf_scale.errors import UserError
from hf_scale.train.data.batches import count_target_tokens
from hf_scale.train.data.packing import model_inputs
from hf_scale.train.model import context_parallel


@dataclass(frozen=True)
class EvalResult:
    loss: float
    tokens: int
    seconds: float

    @property
    def perplexity(self) -> float | None:
        return math.exp(self.loss) if self.loss < 700 else None  # exp overflows past ~709

    def metrics(self, prefix: str = "eval") -> dict[str, float | int | None]:
        return {
            f"{prefix}_loss": self.loss,
            f"{prefix}_perplexity": self.perplexity,
            f"{prefix}_tokens": self.tokens,
            f"{prefix}_runtime": self.seconds,
        }


def strategy_name(args) -> str:
    return str(getattr(args.eval_strategy, "value", args.eval_strategy))


def requested_by(args) -> str | None:
    """The flag that asks for evaluation (TrainingArguments sets do_eval for any --eval_strategy but no)."""
    if strategy_name(args) != "no":
        return f"--eval_strategy {strategy_name(args)}"
    if args.do_eval or args.eval_on_start:
        return "--do_eval" if args.do_eval else "--eval_on_start"
    return None


def check_flags(args) -> None:
    if args.per_device_eval_batch_size < 1:
        raise UserError(f"--per_device_eval_batch_size={args.per_device_eval_batch_size}: must be >= 1")
    if strategy_name(args) == "steps" and args.eval_steps is not None and args.eval_steps <= 0:
        raise UserError(f"--eval_steps={args.eval_steps}: must be > 0 (a fraction < 1 means a fraction of the run)")


@dataclass(frozen=True)
class EvalSchedule:
    """When the manual loop evaluates: the Trainer's --eval_strategy/--eval_steps/--eval_on_start rules,
    plus once at the end of training (run_clm's --do_eval) unless the last step was just evaluated."""

    strategy: str
    interval: int | None
    on_start: bool
    at_end: bool

    @classmethod
    def from_args(cls, args, total_steps: int) -> EvalSchedule:
        strategy = strategy_name(args)
        interval = None
        if strategy == "steps":
            steps = args.eval_steps if args.eval_steps is not None else args.logging_steps
            interval = max(1, math.ceil(steps * total_steps)) if steps < 1 else int(steps)
        return cls(strategy, interval, bool(args.eval_on_start), bool(args.do_eval))

    def after_step(self, step: int) -> bool:
        return self.interval is not None and step % self.interval == 0


def rank_batches(num_examples: int, batch_size: int, rank: int, world_size: int) -> list[tuple[list[int], bool]]:
    """This rank's eval micro-batches as (example indices, counts?): batch k of the ordered set goes to
    rank k % world_size; every rank gets the same number, the missing ones a not-counted copy of batch 0."""
    batches = [list(range(start, min(start + batch_size, num_examples)))
               for start in range(0, num_examples, batch_size)]
    per_rank = math.ceil(len(batches) / world_size)
    mine = []
    for k in range(per_rank):
        index = k * world_size + rank
        mine.append((batches[index], True) if index < len(batches) else (batches[0], False))
    return mine


ONE_PROCESS = Layout()
"""No TP/CP/SP group: every rank evaluates its own batches."""


@torch.no_grad()
def evaluate(model, dataset, collator, accelerator, *, batch_size: int, num_workers: int = 0,
             inputs=model_inputs, progress_bar: bool = True, layout: Layout = ONE_PROCESS) -> EvalResult:
    """Every rank must call this (collective). `model` is the prepared (wrapped) model; `inputs` turns a
    collated batch into the model's keyword arguments, as the training step does; `progress_bar`: false for
    --disable_tqdm; `layout`: the ranks of one TP/CP/SP group (neighbours) evaluate the same batches; a CP group
    shards each of them as in training (the whole sequence may not fit one rank), SP evaluates them whole
    (accelerate's Ulysses is off in eval)."""
    start = time.perf_counter()
    model_parallel = layout.model_parallel_size
    plan = rank_batches(len(dataset), batch_size, accelerator.process_index // model_parallel,
                        accelerator.num_processes // model_parallel)
    loader = DataLoader(dataset, batch_sampler=[indices for indices, _ in plan], collate_fn=collator,
                        num_workers=num_workers)
    device = accelerator.device
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # summed token losses, target tokens
    was_training = model.training
    model.eval()
    try:
        progress = tqdm(zip(loader, plan, strict=True), total=len(plan), desc="evaluating", unit="batch",
                        leave=False, dynamic_ncols=True, disable=not (progress_bar and accelerator.is_main_process))
        for batch, (_, counts) in progress:
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            targets = count_target_tokens(batch)
            # The loss is sum(token losses) / num_items_in_batch (or the mean, for models that ignore it):
            # times the target count it is the batch's summed token loss either way. No KV cache: with one,
            # transformers ignores packed rows' position ids and packed examples would attend to each other.
            n_targets = torch.tensor(targets, device=device)
            with context_parallel.sharded(accelerator, batch, layout):  # counted before: the batch shards in place
                loss = model(**inputs(batch), num_items_in_batch=n_targets, use_cache=False).loss
            if counts:
                totals += torch.stack([loss.detach().double() * targets, totals.new_tensor(targets)])
    finally:
        if was_training:
            model.train()
    # Each rank of a group counted the whole batch's targets; a CP rank's loss is its chunks' share of the sum.
    copies = totals.new_tensor([model_parallel // layout.cp, model_parallel])
    loss_sum, tokens = (accelerator.reduce(totals, reduction="sum") / copies).tolist()
    return EvalResult(loss=loss_sum / tokens, tokens=int(tokens), seconds=time.perf_counter() - start)
