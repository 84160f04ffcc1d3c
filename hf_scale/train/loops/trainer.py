"""The HF Trainer path (`--loop trainer`).

The stock Trainer already normalises the loss by the target tokens of the whole accumulation window
across ranks (`average_tokens_across_devices`). hf_scale adds the runtime guard before the first
step and the same per-step `metrics.jsonl` as the manual loop, with unrounded losses (the Trainer's
own log rounds to 4 digits), and evaluates with hf_scale.train.loops.evaluation, as the manual loop does.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME

from hf_scale.contract import checkpoint_integrity, checkpoint_layout
from hf_scale.train.checkpoint import ownership, resume, store
from hf_scale.train.checkpoint.save import save_with_accelerator
from hf_scale.train.data.batches import micro_batch_per_rank
from hf_scale.train.data.packing import SEQ_LENGTHS, model_inputs
from hf_scale.train.loops import divergence, evaluation, live
from hf_scale.train.loops.metrics import StepMetrics, count_real_tokens
from hf_scale.train.model import context_parallel, fsdp, parallelize, router_loss, sequence_parallel
from hf_scale.train.model.fp8 import with_fp8
from hf_scale.train.setup import guard
from hf_scale.train.setup.distributed import has_gpu
from hf_scale.train.setup.run_spec import RunSpec


class HfScaleTrainer(Trainer):
    """A Trainer that remembers each optimizer step's loss, token count and gradient norm, and whose
    checkpoints appear complete (sealed with hf_scale's manifest) or not at all."""

    def __init__(self, *args, spec: RunSpec, **kwargs):
        self.spec = spec  # before the Trainer builds its Accelerator (_build_accelerator_args reads it)
        """The run's facts (train/setup/run_spec.py): its checkpoints' hf_scale_state.json is written from them."""
        with _checkpoints_allowed_on_a_mesh(kwargs["args"], parallelize.sharded_at_load(spec.layout)):
            super().__init__(*args, **kwargs)
        if spec.layout.sp > 1:
            self.loss_is_scaled_for_ga = True  # compute_loss divides by the window's targets (below)
        self.window_loss = 0.0
        self.window_tokens = 0
        self.window_aux = 0.0
        self.router = router_loss.take_over(self.model)
        """The MoE router's aux loss compute_loss adds per micro-batch (model/router_loss.py), or None."""
        self.window_data_wait_s = 0.0
        self.live_window = live.Window()  # what this rank's training steps saw in the current optimizer step
        self.last_grad_norm = None
        self.last_eval: evaluation.EvalResult | None = None
        self._saving_step: int | None = None
        self._finalizing = False
        self.last_saved_step: int | None = None
        """The step of the last checkpoint this run published."""
        self.publisher = store.Publisher(self.args.output_dir, self.accelerator)

    def _build_accelerator_args(self, **kwargs):
        # FP8: accelerate's fp8 mode with hf_scale's recipe (train/model/fp8.py); TrainingArguments knows only bf16.
        args = with_fp8(super()._build_accelerator_args(**kwargs), self.spec)
        # SP or CP; under CP the Trainer shards each batch itself (_prepare_context_parallel_inputs) and scales the
        # loss by num_processes // tp (model/context_parallel.py has the rule).
        config = parallelize.accelerate_parallelism_config(self.spec.layout, self.spec.cp_comm_strategy)
        if config is not None:
            args["parallelism_config"] = config
        if parallelize.sharded_at_load(self.spec.layout) and not has_gpu():
            # The Trainer hands accelerate a ParallelismConfig for a model built on a TP mesh; accelerate 1.15
            # refuses one on DistributedType.MULTI_CPU. The mesh it would build is set after (create_accelerator_...).
            args.pop("parallelism_config", None)
        return args

    def _set_signature_columns_if_needed(self):
        # Packed rows carry their examples' lengths (SEQ_LENGTHS), which the collator needs but the model's
        # forward does not take: without this the Trainer would drop the column (TRL's SFTTrainer does the same).
        super()._set_signature_columns_if_needed()
        if SEQ_LENGTHS not in self._signature_columns:
            self._signature_columns.append(SEQ_LENGTHS)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        # The whole accumulation window is fetched here: the time the step waited for data.
        waited = time.perf_counter()
        batches = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.window_data_wait_s = time.perf_counter() - waited
        return batches

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.spec.layout.sp > 1 and model.training:
            # The Trainer's SP loss all-gathers the shards' mean losses differentiably, whose backward doubles the
            # gradient at sp=2 (DeepSpeed sums the sp group's gradients), and normalises per micro-batch. The
            # manual loop's proven rule instead: this rank's token-loss sum over the window's targets, times what
            # DeepSpeed's gradient averaging divides by (sequence_parallel.loss_multiplier).
            loss = sequence_parallel.shard_loss(model, inputs, num_items_in_batch) * self._loss_multiplier
            return (loss, None) if return_outputs else loss
        if self.router is None or not model.training:
            return super().compute_loss(model, model_inputs(inputs), return_outputs, num_items_in_batch)
        # The router's aux term after the Trainer's data-parallel multiplier: the step holds its mean over the
        # global batch's micro-batches (the model's own term, zeroed by take_over, would count accumulation x ranks).
        loss, outputs = super().compute_loss(model, model_inputs(inputs), True, num_items_in_batch)
        aux = self.router.aux_loss(outputs, inputs)  # over the packed rows' tokens, not their padding
        loss = loss + self.router.step_term(aux, self.current_gradient_accumulation_steps)
        self.window_aux = self.window_aux + router_loss.aux_value(aux)  # a tensor: no wait per micro-batch
        return (loss, outputs) if return_outputs else loss

    def _get_num_items_in_batch(self, batch_samples, device):
        if self.spec.layout.sp <= 1:
            return super()._get_num_items_in_batch(batch_samples, device)
        # SP (the Trainer counts nothing: it forces model_accepts_loss_kwargs off): the targets of the window's
        # adapter micro-batches, summed over all ranks (each holds a disjoint piece of the sequences).
        local = torch.tensor(sum(sequence_parallel.target_count(b) for b in batch_samples), device=device)
        return self.accelerator.reduce(local, reduction="sum") // self.spec.layout.whole_batch_copies

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if parallelize.sharded_at_load(self.spec.layout) and self.accelerator.torch_device_mesh is None:
            # Without GPUs (above): accelerate's own mesh for these sizes, which is all its data loader reads to
            # give the ranks of one TP group the same batches (data_loader.py: process_index // tp). The Trainer
            # prepares the model without it (`is_distributed_loading_by_transformers`: autocast only, no DDP).
            self.accelerator.state.device_mesh = parallelize.accelerate_mesh(self.spec.layout, self.accelerator.device)
        if self.is_deepspeed_enabled:
            # The Trainer accumulates itself and hands accelerate num_steps=1; with DeepSpeed accelerate's prepare
            # then warns "Gradient accumulation steps mismatch: GradientAccumulationPlugin has 1, DeepSpeed config
            # has N" and takes DeepSpeed's N. Taking it now leaves the same state without the false alarm.
            self.accelerator.gradient_accumulation_steps = self.args.gradient_accumulation_steps

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.window_tokens += count_real_tokens(inputs)
        self.live_window.add(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        # With token-normalised accumulation the returned loss is sum(token losses) x the multiplier / global
        # targets: summed over all ranks, each whole batch once (the ranks of a TP group hold the same one).
        self.window_loss += float(loss) / (self._loss_multiplier * self.spec.layout.whole_batch_copies)
        return loss

    @property
    def _loss_multiplier(self) -> int:
        """What each rank's loss is multiplied by before backward: the Trainer's own num_processes // tp (the
        data-parallel size, times cp), or under SP sequence_parallel.loss_multiplier."""
        if self.spec.layout.sp > 1:
            return sequence_parallel.loss_multiplier(self.spec.layout, self.spec.zero_stage)
        return context_parallel.loss_multiplier(self.spec.layout, self.spec.data_parallel_size)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        """hf_scale's exact token-weighted eval loss (the Trainer's own averages per-batch means over
        samples, and pads the last batches with repeated samples); logged and passed to the callbacks
        (best-model tracking, metrics.jsonl) like the Trainer's."""
        result = evaluation.evaluate(
            self.model_wrapped,
            self.eval_dataset if eval_dataset is None else eval_dataset,
            self.data_collator,
            self.accelerator,
            batch_size=self.args.per_device_eval_batch_size,
            num_workers=self.args.dataloader_num_workers,
            progress_bar=not self.args.disable_tqdm,
            layout=self.spec.layout,
        )
        self.last_eval = result
        metrics = {k: v for k, v in result.metrics(metric_key_prefix).items() if v is not None}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _get_grad_norm(self, model, grad_norm=None):
        # Private Trainer hook (transformers 5): the only place the step's gradient norm is visible.
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self.last_grad_norm = grad_norm
        return grad_norm

    # --- checkpoints: written under hf_scale's temporary name, sealed, then renamed into place -------------

    def _get_output_dir(self, trial):
        # Private Trainer hook (transformers 5): where _save_checkpoint puts `checkpoint-STEP`. While saving it
        # is `.tmp-checkpoint-STEP/`, so an interrupted save is hf_scale's own temporary directory (removed at
        # the next start), never a checkpoint-STEP without a manifest; the Trainer's own rotation, which would
        # delete any checkpoint-* (also foreign ones), only sees that directory.
        if self._saving_step is not None:
            return str(checkpoint_layout.staging_dir(self.args.output_dir, self._saving_step))
        if self._finalizing:
            # transformers' end of training (`_finalize_training`) lists checkpoint-* here and, under
            # --save_total_limit 1 with a best checkpoint, deletes every one but the best: foreign, damaged and
            # `.kept-K` ones too. It finds none in this name (never created); the Publisher does it (below).
            return str(checkpoint_layout.staging_dir(self.args.output_dir, "end-of-training"))
        return super()._get_output_dir(trial)

    def _finalize_training(self, trial, num_train_samples, start_time):
        # Private Trainer hook (transformers 5): its end-of-training rotation, the Publisher's way (only what
        # verifies is deleted). Collective: every rank runs it.
        self._finalizing = True
        try:
            output = super()._finalize_training(trial, num_train_samples, start_time)
        finally:
            self._finalizing = False
        best = self.state.best_model_checkpoint
        if best is not None and self.args.save_total_limit == 1:
            self.publisher.keep_only_best(best)
            self.accelerator.wait_for_everyone()
        return output

    def _save_checkpoint(self, model, trial):
        step, output_dir = self.state.global_step, self.args.output_dir
        with store.write_errors_reported(checkpoint_layout.checkpoint_name(step), output_dir,
                                              self.publisher.verified):
            self._write_sealed_checkpoint(model, trial, step, Path(output_dir))

    def _write_sealed_checkpoint(self, model, trial, step: int, output_dir: Path) -> None:
        accelerator, is_main = self.accelerator, self.accelerator.is_main_process
        staging = checkpoint_layout.staging_dir(output_dir, step)
        written = checkpoint_layout.checkpoint_dir(staging, step)  # the Trainer appends checkpoint-STEP
        if is_main:
            store.make_staging(output_dir, step)
        accelerator.wait_for_everyone()
        self._saving_step = step
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._saving_step = None
        accelerator.wait_for_everyone()  # every rank's shards are on disk
        final = checkpoint_layout.checkpoint_dir(output_dir, step)
        if is_main:
            store.write_state(written, step=step, spec=self.spec)
            if not (written / checkpoint_layout.MODEL_CONFIG).is_file():
                # The Trainer saves no config or tokenizer with FSDP's SHARDED_STATE_DICT (its save_model
                # writes only a full state dict); `hf-scale export` needs them beside the shards.
                store.write_model_files(written, accelerator.unwrap_model(model), self.processing_class)
        if self.state.best_model_checkpoint == str(written):  # the Trainer recorded the temporary name (every
            self.state.best_model_checkpoint = str(final)     # rank: each loads the best model at the end)
            if is_main:
                self.state.save_to_json(str(written / checkpoint_layout.TRAINER_STATE))
        store.seal(written, step, accelerator)
        self.publisher.publish(written, step)
        self.publisher.rotate(self.args.save_total_limit, protect=self.state.best_model_checkpoint)
        accelerator.wait_for_everyone()
        self.last_saved_step = step

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # Built on a TP mesh, a checkpoint's weights are in its DCP shards (_save_optimizer_and_scheduler): the
        # Trainer's save_model would gather the whole model onto rank 0 at every save as well.
        mesh_checkpoint = parallelize.sharded_at_load(self.spec.layout) and not self.args.save_only_model
        if _internal_call and (mesh_checkpoint or (self.spec.final_save_is_checkpoint and not self.args.save_only_model
                                                   and not getattr(self.model, "peft_config", None))):
            # ZeRO-3 without gathering: transformers' save_model (inside _save_checkpoint) writes the config and
            # tokenizer with an empty weights file it then deletes, and falls back to the engine's whole checkpoint,
            # which _save_checkpoint writes again right after (_save_optimizer_and_scheduler): at 70B about 1 TB twice.
            # Here the files beside the engine's checkpoint only; it is written once. (With LoRA transformers gathers
            # the adapter instead: no fallback, nothing written twice.)
            if self.args.should_save:
                Path(output_dir).mkdir(parents=True, exist_ok=True)
                store.write_model_files(Path(output_dir), self.accelerator.unwrap_model(self.model),
                                             self.processing_class)
                torch.save(self.args, Path(output_dir, TRAINING_ARGS_NAME))
            return
        if not _internal_call and self.is_fsdp_enabled and "FULL_STATE_DICT" not in str(
                self.accelerator.state.fsdp_plugin.state_dict_type):
            # transformers' save_model writes weights under FSDP only for FULL_STATE_DICT (FSDP2's default is
            # SHARDED): the final model would be a directory without weights. Gathered here as the manual loop does
            # (accelerator.get_state_dict gathers whatever the type); checkpoints keep their shards.
            target = output_dir or self.args.output_dir
            save_with_accelerator(self.accelerator, self.model, self.processing_class, target)
            if self.args.should_save:
                torch.save(self.args, Path(target, TRAINING_ARGS_NAME))
            return
        super().save_model(output_dir, _internal_call)

    def final_checkpoint(self) -> Path:
        """ZeRO-3 without gathering (checkpoint/final_checkpoint.py): the checkpoint that is the final model. The
        best one when --load_best_model_at_end loaded it; else the last step's: the one saved at that step (the end
        save of --save_strategy steps, or epoch), or written now (--save_strategy no or best), sealed and rotated
        like every other. A collective."""
        best = self.state.best_model_checkpoint
        if self.args.load_best_model_at_end and best:
            return Path(best)
        step = self.state.global_step
        final = checkpoint_layout.checkpoint_dir(self.args.output_dir, step)
        # transformers' end of training deletes every checkpoint but the best one under --save_total_limit 1.
        is_main = self.accelerator.is_main_process
        complete = checkpoint_layout.is_complete(final) if is_main else None
        present = checkpoint_integrity.broadcast(self.accelerator, complete)
        if self.last_saved_step != step or not present:
            self._save_checkpoint(self.model_wrapped, trial=None)
        return final

    def _save_optimizer_and_scheduler(self, output_dir):
        if not parallelize.sharded_at_load(self.spec.layout):
            return super()._save_optimizer_and_scheduler(output_dir)
        # Built on a TP mesh: the Trainer has no writer for this optimizer state. The manual loop's DCP shards
        # (model and optimizer: every rank its own, resharded on load), and the scheduler as the Trainer saves it.
        fsdp.save_sharded(self.model, self.optimizer, Path(output_dir) / checkpoint_layout.DCP_DIR)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), Path(output_dir) / SCHEDULER_NAME)

    def _load_best_model(self):
        if not parallelize.sharded_at_load(self.spec.layout):
            return super()._load_best_model()
        # --load_best_model_at_end: the Trainer would read the best checkpoint's safetensors into the DTensors.
        with store.load_errors_reported(Path(self.state.best_model_checkpoint)):
            fsdp.load_sharded_model(self.model, Path(self.state.best_model_checkpoint) / checkpoint_layout.DCP_DIR)

    # A checkpoint that verified but does not load is one line, not a traceback (private hooks, transformers 5).
    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if parallelize.sharded_at_load(self.spec.layout):
            return  # the DCP shards hold the weights too; loaded with the optimizer (below), once it exists
        with store.load_errors_reported(Path(resume_from_checkpoint)):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint_dir):
        # Called after every kind of load (DeepSpeed's engine loads its states before): the schedule is this run's.
        with store.load_errors_reported(Path(checkpoint_dir or "")):
            if checkpoint_dir is not None and parallelize.sharded_at_load(self.spec.layout):
                fsdp.load_sharded(self.model, self.optimizer, Path(checkpoint_dir) / checkpoint_layout.DCP_DIR)
                self.lr_scheduler.load_state_dict(torch.load(Path(checkpoint_dir) / SCHEDULER_NAME, weights_only=True))
            else:
                super()._load_optimizer_and_scheduler(checkpoint_dir)
        if checkpoint_dir is not None:
            self.publisher.verified.add(Path(checkpoint_dir).resolve())  # verified before the resume
            resume.continue_schedule(self.lr_scheduler, self.args.learning_rate,
                                     announce=self.accelerator.is_main_process)

    def _load_rng_state(self, checkpoint_dir):
        with store.load_errors_reported(Path(checkpoint_dir or "")):
            super()._load_rng_state(checkpoint_dir)


@contextlib.contextmanager
def _checkpoints_allowed_on_a_mesh(args, sharded_at_load: bool):
    """transformers' Trainer refuses to checkpoint a model built on a TP mesh (`DistributedConfig`): it has no
    writer for its optimizer state ("Pass save_only_model=True or save_strategy='no'"). HfScaleTrainer writes and
    reads that state itself (DCP, _save_optimizer_and_scheduler), so the refusal is passed while the Trainer is
    built; every later read of save_only_model sees the user's value."""
    if not sharded_at_load or args.save_only_model:
        yield
        return
    args.save_only_model = True
    try:
        yield
    finally:
        args.save_only_model = False


class GuardAndMetricsCallback(TrainerCallback):
    """Runs the runtime guard once the model is wrapped and writes metrics.jsonl per optimizer step."""

    def __init__(
        self,
        trainer: HfScaleTrainer,
        spec: RunSpec,
        loaded_partitioned: bool | None,
        flops_per_token: float | None,
    ):
        self.trainer = trainer
        self.spec = spec
        self.loaded_partitioned = loaded_partitioned
        self.flops_per_token = flops_per_token
        self.metrics: StepMetrics | None = None
        self.lr = 0.0
        self.live_recorded = False

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        trainer = self.trainer
        micro = micro_batch_per_rank(train_dataloader, self.spec.data_parallel_size)
        guard.verify_runtime(
            self.spec.expected,
            guard.observe(
                trainer.accelerator, trainer.model_wrapped, micro, loaded_partitioned=self.loaded_partitioned
            ),
        )
        ownership.mark(args.output_dir, trainer.accelerator)  # metrics.jsonl is the run's first file in OUTPUT_DIR
        self.metrics = StepMetrics(
            args.output_dir,
            is_main=state.is_world_process_zero,
            total_steps=state.max_steps,
            world_size=trainer.accelerator.num_processes,
            flops_per_token=self.flops_per_token,
            progress_bar=False,  # the Trainer draws its own
            track_compilations=args.torch_compile,
            first_step=state.global_step,  # restored from the checkpoint when resuming
        )

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.lr = optimizer.param_groups[0]["lr"]  # the rate this update uses

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        device = trainer.accelerator.device
        totals = torch.tensor(
            [trainer.window_loss, float(trainer.window_tokens), float(trainer.window_aux)], dtype=torch.float64,
            device=device
        )
        totals[1] /= self.spec.layout.loader_copies  # each rank of a TP/CP group counted its group's batch
        loss, tokens, aux_sum = trainer.accelerator.reduce(totals, reduction="sum").tolist()
        aux_loss = None
        if trainer.router is not None:  # the mean over every rank's micro-batches (TP copies alike)
            micro_batches = trainer.accelerator.num_processes * trainer.current_gradient_accumulation_steps
            aux_loss = aux_sum / micro_batches
        grad_norm = trainer.last_grad_norm
        record = self.metrics.log_step(
            step=state.global_step,
            loss=loss,
            lr=self.lr,
            grad_norm=None if grad_norm is None else float(grad_norm),
            tokens=int(tokens),
            epoch=state.epoch or 0.0,
            data_wait_s=trainer.window_data_wait_s,
            aux_loss=aux_loss,
        )
        if state.global_step >= state.max_steps:
            _finish_progress_bar(trainer)
        trainer.window_loss = 0.0
        trainer.window_tokens = 0
        trainer.window_aux = 0.0
        if not self.live_recorded:  # the values the run really uses, once it has made a step
            self.live_recorded = True
            live.write(args.output_dir, live.read(trainer.accelerator, trainer.model_wrapped, trainer.optimizer,
                                                  trainer.live_window, max_grad_norm=args.max_grad_norm,
                                                  loop="trainer", step=state.global_step), trainer.accelerator)
        trainer.live_window = live.Window()
        # Before the Trainer's _maybe_log_save_evaluate: a diverged step is never saved.
        divergence.check_step(state.global_step, loss, record["grad_norm"],
                              loss_scaling=self.spec.loss_scaling, output_dir=args.output_dir,
                              trusted=self.trainer.publisher.verified)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.metrics.log_eval(step=state.global_step, epoch=state.epoch or 0.0, result=self.trainer.last_eval)


class CheckpointCallback(TrainerCallback):
    """A checkpoint at the end of the run (the full state, not only the final model), and stop-on-signal.
    (The manifest and the atomic rename are HfScaleTrainer._save_checkpoint's.)"""

    def __init__(self, trainer: HfScaleTrainer, stop: store.StopRequest):
        self.trainer = trainer
        self.stop = stop
        self.preempted = False

    def on_step_end(self, args, state, control, **kwargs):
        if self.stop.agreed(self.trainer.accelerator):
            self.preempted = True
            control.should_save = True
            control.should_training_stop = True
        elif str(getattr(args.save_strategy, "value", args.save_strategy)) == "steps" and (
            state.global_step == state.max_steps
        ):
            control.should_save = True  # the full state at the end, not only the final model


def _finish_progress_bar(trainer: Trainer) -> None:
    """Close the Trainer's progress bar at the last step. The Trainer saves the last checkpoint before it closes
    the bar (on_train_end): the save's own bars would print below it, and the finished bar once more after them."""
    from transformers.trainer_callback import ProgressCallback

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, ProgressCallback) and callback.training_bar is not None:
            callback.training_bar.close()
