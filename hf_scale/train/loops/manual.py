"""The manual Accelerator loop (`--loop accelerate`).

Gradient accumulation follows the same rule as the transformers Trainer so both loops train
identically: each optimizer step takes `gradient_accumulation_steps` micro-batches per rank, counts
the target tokens of the whole window on all ranks, and every micro-batch's summed token loss is
divided by that global count (and multiplied by the world size, because DDP and ZeRO average
gradients over ranks). Micro 2 x accumulation 4 therefore equals micro 8, and 2 ranks equal 1 rank.
Gradient sync is skipped on all but the last micro-batch of a window.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DummyOptim, DummyScheduler
from transformers import Trainer, TrainingArguments, get_scheduler

from hf_scale.errors import UserError
from hf_scale.train.checkpoint import layout as checkpoint_layout
from hf_scale.train.checkpoint import reshard
from hf_scale.train.checkpoint import store as checkpoint
from hf_scale.train.data.batches import count_target_tokens, make_train_dataloader, micro_batch_per_rank
from hf_scale.train.data.packing import model_inputs
from hf_scale.train.loops import divergence, evaluation, live
from hf_scale.train.loops.metrics import StepMetrics, count_real_tokens
from hf_scale.train.model import fsdp
from hf_scale.train.model.fp8 import fp8_handlers
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


def _optimizer_and_scheduler(model, args: TrainingArguments, ds_config: dict | None, total_steps: int):
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
    stop: checkpoint.StopRequest | None = None,
    eval_dataset=None,
) -> LoopResult:
    """Train `spec` with `args`; save `checkpoint-STEP` every --save_steps and at the end; resume from `resume_dir`.

    `eval_dataset`: evaluated by --eval_strategy/--eval_steps/--eval_on_start and at the end (--do_eval).
    """
    ds_plugin = getattr(args, "deepspeed_plugin", None)
    # FSDP2 on CPU (from --hf_scale_config): torch's fully_shard, since accelerate cannot (see fsdp.py).
    shard_ourselves = spec.fsdp_settings is not None and not has_gpu()
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
    length = _Length.of(len(dataloader), accelerator.num_processes, spec.gradient_accumulation_steps, args)
    model, optimizer, dataloader, scheduler = _prepare(accelerator, args, spec, model, dataloader, length.total_steps,
                                                       ds_plugin=ds_plugin, shard_ourselves=shard_ourselves)
    guard.verify_runtime(
        spec.expected,
        guard.observe(accelerator, model, micro_batch_per_rank(dataloader, accelerator.num_processes),
                      loaded_partitioned=loaded_partitioned),
    )
    if accelerator.log_with:
        accelerator.init_trackers("hf_scale", config=report_config)

    saver = _CheckpointSaver(args, spec, accelerator, model, optimizer, tokenizer, shard_ourselves)
    step, epoch, skip_batches = saver.load(resume_dir) if resume_dir is not None else (0, 0, 0)
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
    return Accelerator(
        deepspeed_plugin=ds_plugin,
        fsdp_plugin=fsdp_plugin,
        mixed_precision="fp8" if spec.fp8_backend else spec.precision,
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
        kwargs_handlers=ddp_kwargs_handlers(args) + fp8_handlers(spec),
    )


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
    if shard_ourselves:
        model = fsdp.shard_on_cpu(model, spec.fsdp_settings)
    optimizer, scheduler = _optimizer_and_scheduler(model, args, ds_config, total_steps)
    if shard_ourselves:
        # accelerate would wrap the sharded model in DDP (MULTI_CPU) and save the sharded optimizer state
        # of rank 0 only; both stay with torch (fsdp.save_sharded / load_sharded).
        dataloader, scheduler = accelerator.prepare(dataloader, scheduler)
    else:
        model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
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
    saver: _CheckpointSaver
    metrics: StepMetrics
    length: _Length
    stop: checkpoint.StopRequest | None
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

    def __post_init__(self):
        self.first_step = self.step
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
        batches = iter(self.accelerator.skip_first_batches(self.dataloader, skip) if skip else self.dataloader)
        batches_in_epoch = skip
        while self.step < self.length.total_steps:
            waited = time.perf_counter()
            window = _take(batches, self.spec.gradient_accumulation_steps)
            data_wait_s = time.perf_counter() - waited  # the accelerator idles while the loader catches up
            if not window:
                if self.schedule is not None and self.schedule.strategy == "epoch":
                    self.evaluate(self.epoch_now)
                return False
            loss, tokens, lr, grad_norm = self._optimizer_step(window)
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
            )
            self.epoch_now = record["epoch"]
            if self.step == self.first_step + 1:  # the values the run really uses, once it has made a step
                live.write(self.args.output_dir, live.read(self.accelerator, self.model, self.optimizer,
                                                           live.window_of(window),
                                                           max_grad_norm=self.args.max_grad_norm, loop="accelerate",
                                                           step=self.step), self.accelerator)
            self._log(record)
            divergence.check_step(self.step, loss, record["grad_norm"], loss_scaling=self.spec.loss_scaling,
                                  output_dir=self.args.output_dir)
            # Checkpoints only at optimizer-step boundaries: never with accumulation half done.
            preempted = self.stop is not None and self.stop.agreed(self.accelerator)
            if not preempted and self.schedule is not None and self.schedule.after_step(self.step):
                self.evaluate(self.epoch_now)
            if preempted or self.saver.due(self.step, self.length.total_steps):
                self.saver.save(self.step, self.epoch, batches_in_epoch)
            if preempted:
                return True
        return False

    def _optimizer_step(self, window: list) -> tuple[float, int, float, Any]:
        """One optimizer step over an accumulation window: (its loss, its real tokens on all ranks, the learning
        rate it used, the gradient norm)."""
        accelerator = self.accelerator
        local_targets = torch.tensor(sum(count_target_tokens(b) for b in window), device=accelerator.device)
        global_targets = accelerator.reduce(local_targets, reduction="sum")
        local_tokens = torch.tensor(sum(count_real_tokens(b) for b in window), device=accelerator.device)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate of this update (read before the scheduler moves)
        loss_sum = torch.zeros((), device=accelerator.device)
        for i, batch in enumerate(window):
            loss_sum += self._forward_backward(batch, global_targets, last=i == len(window) - 1)
        # DeepSpeed clips inside its step and reports the norm; otherwise clip here (inf = only measure).
        grad_norm = accelerator.clip_grad_norm_(
            self.model.parameters(), self.args.max_grad_norm if self.args.max_grad_norm > 0 else math.inf
        )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        step_loss = accelerator.reduce(loss_sum, reduction="sum").item()
        tokens = int(accelerator.reduce(local_tokens, reduction="sum").item())
        return step_loss, tokens, lr, grad_norm

    def _forward_backward(self, batch, global_targets, *, last: bool):
        """One micro-batch; returns its share of the step's loss (detached)."""
        accelerator, model = self.accelerator, self.model
        # Same mechanism as transformers' Trainer: tell accelerate (and through it DeepSpeed's
        # accumulation boundary) whether this micro-batch ends the window.
        accelerator.gradient_state._set_sync_gradients(last)
        if self.shard_ourselves:
            fsdp.set_gradient_sync(model, last)
        no_sync_needed = not (last or self.is_deepspeed or self.shard_ourselves)
        sync_context = accelerator.no_sync(model) if no_sync_needed else contextlib.nullcontext()
        with sync_context:
            outputs = model(**model_inputs(batch), num_items_in_batch=global_targets)
            # The model's loss is sum(token losses) / global_targets; gradients are averaged over ranks.
            loss = outputs.loss * accelerator.num_processes
            backward_kwargs = {"scale_wrt_gas": False} if self.is_deepspeed else {}
            accelerator.backward(loss, **backward_kwargs)
        return loss.detach() / accelerator.num_processes

    def evaluate(self, epoch_now: float) -> None:
        result = evaluation.evaluate(
            self.model, self.eval_dataset, self.collator, self.accelerator,
            batch_size=self.args.per_device_eval_batch_size, num_workers=self.args.dataloader_num_workers,
            progress_bar=not self.args.disable_tqdm,
        )
        self._log(self.metrics.log_eval(step=self.step, epoch=epoch_now, result=result))

    def final_checkpoint(self) -> Path:
        """ZeRO-3 without gathering (train/checkpoint/final_checkpoint.py): the last step's checkpoint, saved at that
        step (`_CheckpointSaver.due`); written now only by a resumed run that had no step left to train."""
        if self.saver.last_saved_step != self.step:
            self.saver.save(self.step, self.epoch, self.skip_batches)
        return checkpoint_layout.checkpoint_dir(self.args.output_dir, self.step)

    def _log(self, record: dict) -> None:
        """To the trackers of --report_to (metrics.jsonl is StepMetrics')."""
        if self.accelerator.log_with:
            self.accelerator.log({k: v for k, v in record.items() if v is not None and k != "step"}, step=self.step)


class _CheckpointSaver:
    """Full training state through accelerate's `save_state` (DeepSpeed / FSDP formats underneath),
    published atomically by hf_scale.train.checkpoint.store."""

    def __init__(self, args, spec: RunSpec, accelerator, model, optimizer, tokenizer, shard_ourselves: bool):
        self.args = args
        self.spec = spec
        """The run's facts: the batch arithmetic of the data position, and hf_scale_state.json."""
        self.accelerator = accelerator
        self.model = model
        self.optimizer = optimizer
        self.tokenizer = tokenizer
        self.shard_ourselves = shard_ourselves
        self.interval = _save_interval(args)
        self.last_saved_step: int | None = None
        """The step of the last checkpoint this run published."""

    def due(self, step: int, total_steps: int) -> bool:
        if step == total_steps and self.spec.final_save_is_checkpoint:
            return True  # the run's final model is this checkpoint (hf_scale.train.checkpoint.final_checkpoint)
        if self.interval is None:
            return False
        interval = self.interval if self.interval >= 1 else max(1, math.ceil(self.interval * total_steps))
        return step % interval == 0 or step == total_steps

    def save(self, step: int, epoch: int, batches_in_epoch: int) -> Path:
        with checkpoint.write_errors_reported(checkpoint_layout.checkpoint_name(step), self.args.output_dir):
            return self._save(step, epoch, batches_in_epoch)

    def _save(self, step: int, epoch: int, batches_in_epoch: int) -> Path:
        accelerator, args = self.accelerator, self.args
        tmp = checkpoint_layout.staging_dir(args.output_dir, step)
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        if self.shard_ourselves:
            fsdp.save_sharded(self.model, self.optimizer, tmp / checkpoint_layout.DCP_DIR)
        if accelerator.is_main_process:
            samples_per_batch_row = self.spec.micro_batch_size * self.spec.world_size
            checkpoint.write_state(
                tmp,
                step=step,
                spec=self.spec,
                epoch=epoch,
                samples_consumed_in_epoch=batches_in_epoch * samples_per_batch_row,
            )
            checkpoint.write_model_files(tmp, accelerator.unwrap_model(self.model), self.tokenizer)
        accelerator.wait_for_everyone()
        checkpoint.seal(tmp, step, accelerator)
        final = checkpoint_layout.checkpoint_dir(args.output_dir, step)
        if accelerator.is_main_process:
            checkpoint.publish(tmp, args.output_dir, step)
            checkpoint.rotate(args.output_dir, args.save_total_limit)
        accelerator.wait_for_everyone()
        self.last_saved_step = step
        return final

    def load(self, path: Path) -> tuple[int, int, int]:
        """Restore everything, also at another world size (hf_scale.train.checkpoint.reshard; main.py has already
        refused what cannot resume); returns (step, epoch, micro-batches per rank to skip in that epoch)."""
        state = checkpoint.read_state(path)
        world = self.spec.world_size
        samples_per_batch_row = self.spec.micro_batch_size * world
        if state["samples_consumed_in_epoch"] % samples_per_batch_row:
            raise UserError(
                f"--resume_from_checkpoint={path}: {state['samples_consumed_in_epoch']} samples of epoch "
                f"{state['epoch']} were consumed, not a whole number of micro-batches of "
                f"{self.spec.micro_batch_size} x {world} processes"
            )
        with checkpoint.load_errors_reported(path):
            if state["world_size"] != world and self.spec.strategy == "deepspeed":
                work_root = Path(self.args.output_dir)
                with reshard.deepspeed_universal(path, self.accelerator, self.model, work_root) as view:
                    self.accelerator.load_state(str(view))
            else:
                # Full states (DDP, one process) load at any world size; FSDP2's DCP shards reshard on load.
                self.accelerator.load_state(str(path))
            if self.shard_ourselves:
                fsdp.load_sharded(self.model, self.optimizer, path / checkpoint_layout.DCP_DIR)
        return state["step"], state["epoch"], state["samples_consumed_in_epoch"] // samples_per_batch_row


def _dynamo_plugin(args):
    """--torch_compile / --torch_compile_backend / --torch_compile_mode, as the Trainer reads them."""
    if not args.torch_compile:
        return None
    from accelerate.utils import TorchDynamoPlugin

    return TorchDynamoPlugin(backend=args.torch_compile_backend or "inductor", mode=args.torch_compile_mode)


def _save_interval(args) -> float | None:
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if strategy == "no":
        return None
    if strategy != "steps":
        raise UserError(f"--save_strategy={strategy}: the accelerate loop saves by steps; use steps or no")
    return args.save_steps


def _as_float(value) -> float | None:
    if value is None:
        return None
    return fsdp.as_local_float(value) if torch.is_tensor(value) else float(value)
