"""The manual loop's checkpoints: when one is due, the full training state written through accelerate's
`save_state` (DeepSpeed / FSDP formats underneath) and published atomically, and restored on resume, also at
another world size."""

from __future__ import annotations

import math
from pathlib import Path

from hf_scale.contract import checkpoint_layout, checkpoint_verification
from hf_scale.errors import UserError
from hf_scale.train.checkpoint import reshard, store
from hf_scale.train.model import fsdp
from hf_scale.train.setup.run_spec import RunSpec


class CheckpointSaver:
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
        self.publisher = store.Publisher(args.output_dir, accelerator)

    def due(self, step: int, total_steps: int) -> bool:
        if step == total_steps and self.spec.final_save_is_checkpoint:
            return True  # the run's final model is this checkpoint (hf_scale.train.checkpoint.final_checkpoint)
        if self.interval is None:
            return False
        interval = self.interval if self.interval >= 1 else max(1, math.ceil(self.interval * total_steps))
        return step % interval == 0 or step == total_steps

    def save(self, step: int, epoch: int, batches_in_epoch: int) -> Path:
        with store.write_errors_reported(checkpoint_layout.checkpoint_name(step), self.args.output_dir,
                                              self.publisher.verified):
            return self._save(step, epoch, batches_in_epoch)

    def _save(self, step: int, epoch: int, batches_in_epoch: int) -> Path:
        accelerator, args = self.accelerator, self.args
        tmp = checkpoint_layout.checkpoint_dir(checkpoint_layout.staging_dir(args.output_dir, step), step)
        if accelerator.is_main_process:
            store.make_staging(args.output_dir, step)
            tmp.mkdir()
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        if self.shard_ourselves:
            fsdp.save_sharded(self.model, self.optimizer, tmp / checkpoint_layout.DCP_DIR)
        if accelerator.is_main_process:
            samples_per_batch_row = self.spec.micro_batch_size * self.spec.data_parallel_size
            store.write_state(
                tmp,
                step=step,
                spec=self.spec,
                epoch=epoch,
                samples_consumed_in_epoch=batches_in_epoch * samples_per_batch_row,
            )
            store.write_model_files(tmp, accelerator.unwrap_model(self.model), self.tokenizer)
        accelerator.wait_for_everyone()
        store.seal(tmp, step, accelerator)
        final = self.publisher.publish(tmp, step)
        self.publisher.rotate(args.save_total_limit)
        accelerator.wait_for_everyone()
        return final

    def load(self, path: Path) -> tuple[int, int, int]:
        """Restore everything, also at another world size (hf_scale.train.checkpoint.reshard; main.py has already
        refused what cannot resume); returns (step, epoch, micro-batches per rank to skip in that epoch)."""
        state = checkpoint_verification.read_state(path)
        world = self.spec.world_size
        samples_per_batch_row = self.spec.micro_batch_size * self.spec.data_parallel_size
        if state["samples_consumed_in_epoch"] % samples_per_batch_row:
            raise UserError(
                f"--resume_from_checkpoint={path}: {state['samples_consumed_in_epoch']} samples of epoch "
                f"{state['epoch']} were consumed, not a whole number of micro-batches of "
                f"{self.spec.micro_batch_size} x {self.spec.data_parallel_size} data-parallel processes"
            )
        self.publisher.verified.add(path.resolve())  # verified before the resume (checkpoint.resolve_resume)
        with store.load_errors_reported(path):
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


def _save_interval(args) -> float | None:
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if strategy == "no":
        return None
    if strategy != "steps":
        raise UserError(f"--save_strategy={strategy}: the accelerate loop saves by steps; use steps or no")
    return args.save_steps
