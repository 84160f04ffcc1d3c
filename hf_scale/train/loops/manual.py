"""The manual Accelerator loop (`--loop accelerate`).

Gradient accumulation follows the same rule as the transformers Trainer so both loops train
identically: each optimizer step takes `gradient_accumulation_steps` micro-batches per rank, counts
the target tokens of the whole window on all ranks, and every micro-batch's summed token loss is
divided by that global count (and multiplied by the data-parallel size, because DDP, ZeRO and FSDP average
gradients over ranks; the ranks of one tensor-parallel group share a batch and count it once; sequence-parallel
ranks hold disjoint shards, see train/model/sequence_parallel.py). Micro 2 x
accumulation 4 therefore equals micro 8, and 2 ranks equal 1 rank.
Gradient sync is skipped on all but the last micro-batch of a window.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from transformers import TrainingArguments

from hf_scale.contract import checkpoint_layout
from hf_scale.train.checkpoint import ownership, resume, store
from hf_scale.train.data.batches import make_train_dataloader, micro_batch_per_rank, target_tokens
from hf_scale.train.data.packing import model_inputs
from hf_scale.train.loops import divergence, evaluation, live
from hf_scale.train.loops.manual_checkpoints import CheckpointSaver
from hf_scale.train.loops.metrics import StepMetrics, real_tokens
from hf_scale.train.loops.optimizer import optimizer_and_scheduler
from hf_scale.train.model import context_parallel, fsdp, parallelize, router_loss, sequence_parallel
from hf_scale.train.model.fp8 import with_fp8
from hf_scale.train.model.liger import apply_liger
from hf_scale.train.setup import guard
from hf_scale.train.setup.distributed import has_gpu
from hf_scale.train.setup.run_spec import RunSpec


@dataclass
class LoopResult:
    accelerator: Accelerator
    model: torch.nn.Module
    """The prepared (wrapped) model."""
    metrics: StepMetrics
    preempted: bool = False
    """Stopped by SIGTERM/SIGUSR1 after saving a checkpoint."""
    final_checkpoint: Callable[[], Path] | None = None
    """ZeRO-3 without gathering: the final step's checkpoint, the run's final model (_Loop.final_checkpoint)."""


def _take(iterator, n: int) -> list:
    window = []
    for _ in range(n):
        try:
            window.append(next(iterator))
        except StopIteration:
            break
    return window


def run(
    *,
    args: TrainingArguments,
    spec: RunSpec,
    model,
    tokenizer,
    train_dataset,
    collator,
    loaded_partitioned: bool | None,
    flops_per_token: float | None,
    report_config: dict,
    resume_dir: Path | None = None,
    stop: store.StopRequest | None = None,
    eval_dataset=None,
) -> LoopResult:
    """Train `spec` with `args`; save `checkpoint-STEP` every --save_steps and at the end; resume from `resume_dir`.

    `eval_dataset`: evaluated by --eval_strategy/--eval_steps/--eval_on_start and at the end (--do_eval).
    """
    ds_plugin = getattr(args, "deepspeed_plugin", None)
    # FSDP2 on CPU (from --hf_scale_config): torch's fully_shard, since accelerate cannot (see fsdp.py); a TP
    # model comes sharded from from_pretrained (parallelize.py). accelerate then prepares only loader and scheduler.
    shard_ourselves = (spec.fsdp_settings is not None and not has_gpu()) or parallelize.sharded_at_load(spec.layout)
    accelerator = _accelerator(args, spec, model, ds_plugin, shard_ourselves)
    dataloader = make_train_dataloader(
        train_dataset,
        collator,
        spec.micro_batch_size,
        spec.seed,
        num_workers=args.dataloader_num_workers,
        pin_memory=args.dataloader_pin_memory and has_gpu(),
        prefetch_factor=args.dataloader_prefetch_factor,
        persistent_workers=args.dataloader_persistent_workers,
    )
    length = _Length.of(len(dataloader), spec.data_parallel_size, spec.gradient_accumulation_steps, args)
    model, optimizer, dataloader, scheduler = _prepare(accelerator, args, spec, model, dataloader, length.total_steps,
                                                       ds_plugin=ds_plugin, shard_ourselves=shard_ourselves)
    guard.verify_runtime(
        spec.expected,
        guard.observe(accelerator, model, micro_batch_per_rank(dataloader, spec.data_parallel_size),
                      loaded_partitioned=loaded_partitioned),
    )
    if accelerator.log_with:
        accelerator.init_trackers("hf_scale", config=report_config)

    saver = CheckpointSaver(args, spec, accelerator, model, optimizer, tokenizer, shard_ourselves)
    step, epoch, skip_batches = saver.load(resume_dir) if resume_dir is not None else (0, 0, 0)
    if resume_dir is not None:
        resume.continue_schedule(scheduler, args.learning_rate, announce=accelerator.is_main_process)
    ownership.mark(args.output_dir, accelerator)  # metrics.jsonl is the run's first file in OUTPUT_DIR
    metrics = StepMetrics(
        args.output_dir,
        is_main=accelerator.is_main_process,
        total_steps=length.total_steps,
        world_size=accelerator.num_processes,
        flops_per_token=flops_per_token,
        first_step=step,
        track_compilations=args.torch_compile,
        progress_bar=not args.disable_tqdm,
    )
    loop = _Loop(
        args=args, spec=spec, accelerator=accelerator, model=model, optimizer=optimizer, scheduler=scheduler,
        dataloader=dataloader, collator=collator, saver=saver, metrics=metrics, length=length, stop=stop,
        eval_dataset=eval_dataset, is_deepspeed=ds_plugin is not None, shard_ourselves=shard_ourselves,
        step=step, epoch=epoch, skip_batches=skip_batches,
    )
    preempted = loop.train()
    if accelerator.log_with:
        accelerator.end_training()
    return LoopResult(accelerator=accelerator, model=model, metrics=metrics, preempted=preempted,
                      final_checkpoint=loop.final_checkpoint)


def _accelerator(args: TrainingArguments, spec: RunSpec, model, ds_plugin, shard_ourselves: bool) -> Accelerator:
    fsdp_plugin = None
    if spec.fsdp_settings is not None and not shard_ourselves:
        fsdp_plugin = fsdp.accelerate_plugin(model, spec.fsdp_settings)
    return Accelerator(**with_fp8(dict(
        deepspeed_plugin=ds_plugin,
        fsdp_plugin=fsdp_plugin,
        mixed_precision=spec.precision,
        # This loop does the accumulation (like the Trainer), so accelerate must not divide the loss again.
        gradient_accumulation_steps=spec.gradient_accumulation_steps if ds_plugin else 1,
        # Every rank shuffles with the same seed (the Trainer's choice too: --data_seed, else --seed).
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=spec.data_seed),
        # The schedule counts optimizer steps of the whole job (as in the Trainer); by default accelerate
        # would advance it once per process on every step.
        step_scheduler_with_optimizer=False,
        log_with=[r for r in args.report_to if r != "none"] or None,
        project_dir=args.output_dir,
        dynamo_plugin=_dynamo_plugin(args),
        kwargs_handlers=ddp_kwargs_handlers(args),
        parallelism_config=parallelize.accelerate_parallelism_config(spec.layout, spec.cp_comm_strategy),
    ), spec))


def ddp_kwargs_handlers(args: TrainingArguments) -> list:
    """The --ddp_* settings that were given, handed to accelerate's DDP wrapper as the Trainer hands them
    (``Trainer._build_accelerator_args``). Unlike the Trainer, no flag keeps accelerate's default of
    find_unused_parameters=False, not the Trainer's True for a model without activation checkpointing: the
    extra graph traversal per step is only needed by models with branches unused in a forward."""
    from accelerate.utils import DistributedDataParallelKwargs

    settings = {
        "find_unused_parameters": args.ddp_find_unused_parameters,
        "bucket_cap_mb": args.ddp_bucket_cap_mb,
        "broadcast_buffers": args.ddp_broadcast_buffers,
        "static_graph": args.ddp_static_graph,
    }
    given = {key: value for key, value in settings.items() if value is not None}
    return [DistributedDataParallelKwargs(**given)] if given else []


@dataclass(frozen=True)
class _Length:
    """How long the run is, in the loader's micro-batches and in optimizer steps."""

    batches_per_epoch: int
    """Micro-batches per rank in one epoch."""
    total_steps: int

    @classmethod
    def of(cls, loader_batches: int, num_processes: int, accumulation: int, args: TrainingArguments) -> _Length:
        batches_per_epoch = math.ceil(loader_batches / num_processes)
        steps_per_epoch = max(1, math.ceil(batches_per_epoch / accumulation))
        # The Trainer's count (and launch_values.planned_optimizer_steps'): a fractional epoch is part of one.
        total_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
        return cls(batches_per_epoch=batches_per_epoch, total_steps=total_steps)


def _prepare(accelerator, args, spec: RunSpec, model, dataloader, total_steps: int, *, ds_plugin,
             shard_ourselves: bool):
    """Optimizer and scheduler (the Trainer's choices), and everything handed to accelerate's prepare."""
    ds_config = None
    if ds_plugin is not None:
        hf_ds_config = ds_plugin.hf_ds_config
        hf_ds_config.trainer_config_finalize(args, model, total_steps)
        ds_config = hf_ds_config.config
    apply_liger(model, args)  # as the Trainer does in train(): before the model is wrapped
    if shard_ourselves and not parallelize.sharded_at_load(spec.layout):
        model = fsdp.shard_on_cpu(model, spec.fsdp_settings)
    optimizer, scheduler = optimizer_and_scheduler(model, args, ds_config, total_steps)
    if shard_ourselves:
        # accelerate would wrap the sharded model in DDP (MULTI_CPU) and save the sharded optimizer state
        # of rank 0 only; both stay with torch (fsdp.save_sharded / load_sharded).
        dataloader = parallelize.prepare_data(accelerator, dataloader, spec.layout)  # split by data-parallel rank
        scheduler = accelerator.prepare(scheduler)
    else:
        model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
        if spec.layout.sp > 1:
            dataloader = sequence_parallel.Batches(dataloader)  # the Ulysses adapter prepare put around it
    return model, optimizer, dataloader, scheduler


@dataclass
class _Loop:
    """The prepared pieces of one run and its place in the data: epochs of optimizer steps until the run's
    length, evaluations and checkpoints between them."""

    args: TrainingArguments
    spec: RunSpec
    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    dataloader: Any
    collator: Any
    saver: CheckpointSaver
    metrics: StepMetrics
    length: _Length
    stop: store.StopRequest | None
    eval_dataset: Any
    is_deepspeed: bool
    shard_ourselves: bool
    step: int = 0
    epoch: int = 0
    skip_batches: int = 0
    """Micro-batches per rank already consumed in the resumed epoch."""
    epoch_now: float = 0.0
    """The fractional epoch of the last step (for the eval records)."""
    schedule: evaluation.EvalSchedule | None = field(init=False, default=None)
    first_step: int = field(init=False, default=0)
    """The step the run started (or resumed) from."""
    router: router_loss.Router | None = field(init=False, default=None)
    """The MoE router's aux loss this loop adds per micro-batch (train/model/router_loss.py), or None."""

    def __post_init__(self):
        self.first_step = self.step
        self.router = router_loss.take_over(self.model)
        if self.eval_dataset is not None:
            self.schedule = evaluation.EvalSchedule.from_args(self.args, self.length.total_steps)

    def train(self) -> bool:
        """Epochs until the run's length; True when a signal stopped it (after its checkpoint)."""
        if self.schedule is not None and self.schedule.on_start:
            self.evaluate(float(self.epoch))
        self.model.train()
        preempted = False
        self.epoch_now = float(self.epoch)
        while self.step < self.length.total_steps and not preempted:
            preempted = self._epoch()
            if not preempted:
                self.epoch += 1
        if (self.schedule is not None and self.schedule.at_end and not preempted
                and self.metrics.last_eval_step != self.step):
            self.evaluate(self.epoch_now)
        return preempted

    def _epoch(self) -> bool:
        """The rest of the current epoch (or of the run); True when a signal stopped it."""
        self.dataloader.set_epoch(self.epoch)
        skip, self.skip_batches = self.skip_batches, 0
        batches = iter(self._rest_of_epoch(skip))
        batches_in_epoch = skip
        while self.step < self.length.total_steps:
            waited = time.perf_counter()
            window = _take(batches, self.spec.gradient_accumulation_steps)
            data_wait_s = time.perf_counter() - waited  # the accelerator idles while the loader catches up
            if not window:
                if self.schedule is not None and self.schedule.strategy == "epoch":
                    self.evaluate(self.epoch_now)
                return False
            loss, tokens, lr, grad_norm, aux_loss = self._optimizer_step(window)
            self.step += 1
            batches_in_epoch += len(window)
            record = self.metrics.log_step(
                step=self.step,
                loss=loss,
                lr=lr,
                grad_norm=_as_float(grad_norm),
                tokens=tokens,
                epoch=self.epoch + batches_in_epoch / self.length.batches_per_epoch,
                data_wait_s=data_wait_s,
                aux_loss=aux_loss,
            )
            self.epoch_now = record["epoch"]
            if self.step == self.first_step + 1:  # the values the run really uses, once it has made a step
                live.write(self.args.output_dir, live.read(self.accelerator, self.model, self.optimizer,
                                                           live.window_of(window),
                                                           max_grad_norm=self.args.max_grad_norm, loop="accelerate",
                                                           step=self.step), self.accelerator)
            self._log(record)
            divergence.check_step(self.step, loss, record["grad_norm"], loss_scaling=self.spec.loss_scaling,
                                  output_dir=self.args.output_dir, trusted=self.saver.publisher.verified)
            # Checkpoints only at optimizer-step boundaries: never with accumulation half done.
            preempted = self.stop is not None and self.stop.agreed(self.accelerator)
            if not preempted and self.schedule is not None and self.schedule.after_step(self.step):
                self.evaluate(self.epoch_now)
            if preempted or self.saver.due(self.step, self.length.total_steps):
                self.saver.save(self.step, self.epoch, batches_in_epoch)
            if preempted:
                return True
        return False

    def _rest_of_epoch(self, skip: int):
        """The epoch's micro-batches after this rank's first `skip` (a resumed checkpoint's data position)."""
        if not skip:
            return self.dataloader
        if isinstance(self.dataloader, sequence_parallel.Batches):  # sp > 1: skipped under DeepSpeed's adapter
            return self.dataloader.resumed(self.accelerator, skip)
        return self.accelerator.skip_first_batches(self.dataloader, skip)

    def _optimizer_step(self, window: list) -> tuple[float, int, float, Any, float | None]:
        """One optimizer step over an accumulation window: (its loss, its real tokens on all ranks, the learning
        rate it used, the gradient norm, the mean router aux loss of its micro-batches or None without one)."""
        accelerator = self.accelerator
        sp = self.spec.layout.sp > 1
        # Counted as tensors where the batches are: no wait for the device per micro-batch (as the Trainer counts).
        targets = sequence_parallel.target_tokens if sp else target_tokens
        local_targets = sum(targets(b) for b in window).to(accelerator.device)
        # The ranks of one TP or CP group hold the same batch here: count each data-parallel rank's tokens once (SP
        # ranks hold disjoint shards of theirs already; CP ranks shard theirs in the forward).
        copies = self.spec.layout.loader_copies
        global_targets = accelerator.reduce(local_targets, reduction="sum") // copies
        local_tokens = sum(real_tokens(b) for b in window).to(accelerator.device)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate of this update (read before the scheduler moves)
        loss_sum = torch.zeros((), device=accelerator.device)
        aux_sum = torch.zeros((), device=accelerator.device)
        for i, batch in enumerate(window):
            loss, aux = self._forward_backward(batch, global_targets, last=i == len(window) - 1, window=len(window))
            loss_sum += loss
            aux_sum += aux
        # DeepSpeed clips inside its step and reports the norm; otherwise clip here (inf = only measure).
        max_norm = self.args.max_grad_norm if self.args.max_grad_norm > 0 else math.inf
        grad_norm = (parallelize.clip_grad_norm(self.model, max_norm) if parallelize.sharded_at_load(self.spec.layout)
                     else accelerator.clip_grad_norm_(self.model.parameters(), max_norm))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        # Each rank's loss is its share of the whole batch's (CP and SP shares disjoint; TP's copies of one).
        step_loss = accelerator.reduce(loss_sum, reduction="sum").item() / self.spec.layout.whole_batch_copies
        tokens = int(accelerator.reduce(local_tokens, reduction="sum").item()) // copies
        aux_loss = None
        if self.router is not None:  # the mean over every rank's micro-batches (TP copies alike)
            aux_loss = accelerator.reduce(aux_sum, reduction="mean").item() / len(window)
        return step_loss, tokens, lr, grad_norm, aux_loss

    def _forward_backward(self, batch, global_targets, *, last: bool, window: int):
        """One micro-batch of a window of ``window``; returns its share of the step's loss and its router aux loss
        (both detached; the aux loss 0 without one)."""
        accelerator, model = self.accelerator, self.model
        # Same mechanism as transformers' Trainer: tell accelerate (and through it DeepSpeed's
        # accumulation boundary) whether this micro-batch ends the window.
        accelerator.gradient_state._set_sync_gradients(last)
        if self.shard_ourselves and self.spec.data_parallel_size > 1:
            fsdp.set_gradient_sync(model, last)
        no_sync_needed = not (last or self.is_deepspeed or self.shard_ourselves)
        sync_context = accelerator.no_sync(model) if no_sync_needed else contextlib.nullcontext()
        # cp > 1: the batch is sharded over the cp group (in place) and attention is ring attention, for the forward
        # and the backward.
        with sync_context, context_parallel.sharded(accelerator, batch, self.spec.layout):
            # The loss is sum(token losses) / global_targets; gradients are averaged over data-parallel ranks.
            if self.spec.layout.sp > 1:
                loss = sequence_parallel.shard_loss(model, batch, global_targets)
                multiplier = sequence_parallel.loss_multiplier(self.spec.layout, self.spec.zero_stage)
                outputs = None
            else:
                outputs = model(**model_inputs(batch), num_items_in_batch=global_targets)
                loss = outputs.loss
                multiplier = context_parallel.loss_multiplier(self.spec.layout, self.spec.data_parallel_size)
            # The router's aux term after the multiplier: the step holds its mean over the global batch's micro-batches
            # (over the packed rows' tokens, not their padding).
            aux = self.router.aux_loss(outputs, batch) if self.router is not None and outputs is not None else None
            loss = loss * multiplier + (self.router.step_term(aux, window) if aux is not None else 0.0)
            backward_kwargs = {"scale_wrt_gas": False} if self.is_deepspeed else {}
            accelerator.backward(loss, **backward_kwargs)
        return loss.detach() / multiplier, router_loss.aux_value(aux)

    def evaluate(self, epoch_now: float) -> None:
        result = evaluation.evaluate(
            self.model, self.eval_dataset, self.collator, self.accelerator,
            batch_size=self.args.per_device_eval_batch_size, num_workers=self.args.dataloader_num_workers,
            progress_bar=not self.args.disable_tqdm, layout=self.spec.layout,
        )
        self._log(self.metrics.log_eval(step=self.step, epoch=epoch_now, result=result))

    def final_checkpoint(self) -> Path:
        """ZeRO-3 without gathering (train/checkpoint/final_checkpoint.py): the last step's checkpoint, saved at
        that step (`CheckpointSaver.due`; a resume of the last step trains nothing and never comes here)."""
        return checkpoint_layout.checkpoint_dir(self.args.output_dir, self.step)

    def _log(self, record: dict) -> None:
        """To the trackers of --report_to (metrics.jsonl is StepMetrics')."""
        if self.accelerator.log_with:
            self.accelerator.log({k: v for k, v in record.items() if v is not None and k != "step"}, step=self.step)


def _dynamo_plugin(args):
    """--torch_compile / --torch_compile_backend / --torch_compile_mode, as the Trainer reads them."""
    if not args.torch_compile:
        return None
    from accelerate.utils import TorchDynamoPlugin

    return TorchDynamoPlugin(backend=args.torch_compile_backend or "inductor", mode=args.torch_compile_mode)


def _as_float(value) -> float | None:
    if value is None:
        return None
    return fsdp.as_local_float(value) if torch.is_tensor(value) else float(value)
