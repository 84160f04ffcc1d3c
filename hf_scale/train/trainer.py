"""The HF Trainer path (`--loop trainer`).

The stock Trainer already normalises the loss by the target tokens of the whole accumulation window
across ranks (`average_tokens_across_devices`). hf_scale adds the runtime guard before the first
step and the same per-step `metrics.jsonl` as the manual loop, with unrounded losses (the Trainer's
own log rounds to 4 digits), and evaluates with hf_scale.train.evaluation, as the manual loop does.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback

from hf_scale.train import checkpoint, evaluation, guard
from hf_scale.train.metrics import StepMetrics, count_real_tokens


class HfScaleTrainer(Trainer):
    """A Trainer that remembers each optimizer step's loss, token count and gradient norm."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.window_loss = 0.0
        self.window_tokens = 0
        self.last_grad_norm = None
        self.last_eval: evaluation.EvalResult | None = None

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self.is_deepspeed_enabled:
            # The Trainer accumulates itself and hands accelerate num_steps=1; with DeepSpeed accelerate's prepare
            # then warns "Gradient accumulation steps mismatch: GradientAccumulationPlugin has 1, DeepSpeed config
            # has N" and takes DeepSpeed's N. Taking it now leaves the same state without the false alarm.
            self.accelerator.gradient_accumulation_steps = self.args.gradient_accumulation_steps

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.window_tokens += count_real_tokens(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        # With token-normalised accumulation the returned loss is sum(token losses) * world / global targets.
        self.window_loss += float(loss) / self.accelerator.num_processes
        return loss

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


class GuardAndMetricsCallback(TrainerCallback):
    """Runs the runtime guard once the model is wrapped and writes metrics.jsonl per optimizer step."""

    def __init__(
        self,
        trainer: HfScaleTrainer,
        expected: guard.Expected,
        loaded_partitioned: bool | None,
        flops_per_token: float | None,
    ):
        self.trainer = trainer
        self.expected = expected
        self.loaded_partitioned = loaded_partitioned
        self.flops_per_token = flops_per_token
        self.metrics: StepMetrics | None = None
        self.lr = 0.0

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        trainer = self.trainer
        micro = getattr(train_dataloader, "total_batch_size", None)
        if micro is not None and not getattr(train_dataloader, "split_batches", False):
            micro //= trainer.accelerator.num_processes
        guard.verify_runtime(
            self.expected,
            guard.observe(
                trainer.accelerator, trainer.model_wrapped, micro, loaded_partitioned=self.loaded_partitioned
            ),
        )
        self.metrics = StepMetrics(
            args.output_dir,
            is_main=state.is_world_process_zero,
            total_steps=state.max_steps,
            world_size=trainer.accelerator.num_processes,
            flops_per_token=self.flops_per_token,
            progress_bar=False,  # the Trainer draws its own
        )

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.lr = optimizer.param_groups[0]["lr"]  # the rate this update uses

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        device = trainer.accelerator.device
        totals = torch.tensor(
            [trainer.window_loss, float(trainer.window_tokens)], dtype=torch.float64, device=device
        )
        loss, tokens = trainer.accelerator.reduce(totals, reduction="sum").tolist()
        grad_norm = trainer.last_grad_norm
        self.metrics.log_step(
            step=state.global_step,
            loss=loss,
            lr=self.lr,
            grad_norm=None if grad_norm is None else float(grad_norm),
            tokens=int(tokens),
            epoch=state.epoch or 0.0,
        )
        if state.global_step >= state.max_steps:
            _finish_progress_bar(trainer)
        trainer.window_loss = 0.0
        trainer.window_tokens = 0

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.metrics.log_eval(step=state.global_step, epoch=state.epoch or 0.0, result=self.trainer.last_eval)


class CheckpointCallback(TrainerCallback):
    """The Trainer keeps its own checkpoint format; hf_scale adds what makes it trustworthy: the
    completeness manifest once every rank has written, a final checkpoint, and stop-on-signal."""

    def __init__(self, trainer: HfScaleTrainer, stop: checkpoint.StopRequest, expected: guard.Expected):
        self.trainer = trainer
        self.stop = stop
        self.expected = expected
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

    def on_save(self, args, state, control, **kwargs):
        accelerator = self.trainer.accelerator
        accelerator.wait_for_everyone()  # every rank's shards are on disk
        if state.is_world_process_zero:
            path = Path(args.output_dir) / f"{checkpoint.PREFIX}{state.global_step}"
            checkpoint.write_state(path, step=state.global_step, loop="trainer",
                                   world_size=accelerator.num_processes, expected=self.expected, args=args)
            checkpoint.write_manifest(path, state.global_step)
        accelerator.wait_for_everyone()


def _finish_progress_bar(trainer: Trainer) -> None:
    """Close the Trainer's progress bar at the last step. The Trainer saves the last checkpoint before it closes
    the bar (on_train_end): the save's own bars would print below it, and the finished bar once more after them."""
    from transformers.trainer_callback import ProgressCallback

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, ProgressCallback) and callback.training_bar is not None:
            callback.training_bar.close()
