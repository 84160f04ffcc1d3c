"""DeepSpeed Ulysses sequence parallelism (sp > 1) in the manual loop, accelerate's recipe for
``sp_backend="deepspeed"``: the Accelerator gets a ``ParallelismConfig`` and applies DeepSpeed's two pieces in
``prepare`` (``UlyssesSPAttentionHF`` exchanges heads by all-to-all around SDPA; ``UlyssesSPDataLoaderAdapter``
gathers one loader batch from each rank of an sp group and yields sp micro-batches, each rank 1/sp of every
sequence, with the labels already shifted as ``shift_labels``).

The loader is split over all ranks (accelerate's prepare); one adapter micro-batch is a whole batch of rows that
the sp group computes together, so the loop's accumulation window counts adapter micro-batches and the global
batch is micro x accumulation x data-parallel ranks, as for the other layouts.

The loss (tests/train/model/ulysses_sp_worker.py proves the rule): each rank's share is its token-loss sum over
the window's target count summed over all ranks (the shards are disjoint, so nothing is divided by sp); DeepSpeed
sums the gradients over the sp group, which gives the whole sequences' gradient. accelerate's own SP example
all-gathers the losses differentiably instead, whose backward doubles the gradient at sp=2.
"""

from __future__ import annotations

import itertools

import torch

from hf_scale.config.parallelism import SP_ATTN_IMPLEMENTATIONS, Layout
from hf_scale.train.data.labels import IGNORE_INDEX

MODEL_KEYS = ("input_ids", "position_ids")
"""What an sp micro-batch hands the model: Ulysses attends causally over the gathered sequence and ignores
``attention_mask`` (padding is on the right, so no real token attends to it)."""


def accelerate_config(layout: Layout):
    """The Accelerator's ``parallelism_config`` for this layout (None without sp)."""
    if layout.sp <= 1:
        return None
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    return ParallelismConfig(
        dp_shard_size=layout.dp_shard, sp_size=layout.sp, sp_backend="deepspeed",
        # Rows are padded to the batch's longest (a multiple of sp), so lengths vary from batch to batch.
        # The one kernel hf_scale runs Ulysses around (a YAML asking for another is refused at start).
        sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True,
                                                   sp_attn_implementation=SP_ATTN_IMPLEMENTATIONS[0]),
    )


def collator(inner, layout: Layout, tokenizer, *, pad_to: int | None) -> Collator:
    """The sp collator around the run's, or a one-line refusal of a tokenizer Ulysses cannot run with (the flags
    it cannot run with are refused at start: hf_scale.contract.parallel_refusals.flag_refusal)."""
    from hf_scale.errors import UserError

    where = f"parallelism.sp={layout.sp}"
    if tokenizer.padding_side != "right":
        raise UserError(f"{where}: the tokenizer pads on the {tokenizer.padding_side}; Ulysses ignores "
                        "attention_mask, so padding must be on the right")
    return Collator(inner, layout.sp, tokenizer.pad_token_id, pad_to)


class Collator:
    """The run's collator, then what the adapter needs: sequences padded on the right to a multiple of sp (the
    adapter cuts every sequence in sp equal chunks), to `pad_to` first when given, and ``position_ids`` (each
    chunk keeps its global positions)."""

    def __init__(self, inner, sp: int, pad_token_id: int, pad_to: int | None = None):
        self.inner, self.sp, self.pad_token_id, self.pad_to = inner, sp, pad_token_id, pad_to

    def __call__(self, rows):
        batch = self.inner(rows)
        length = max(batch["input_ids"].shape[1], self.pad_to or 0)
        extra = length - batch["input_ids"].shape[1] + (-length % self.sp)
        fills = {"input_ids": self.pad_token_id, "labels": IGNORE_INDEX, "attention_mask": 0}
        batch = {key: torch.nn.functional.pad(value, (0, extra), value=fills[key]) if key in fills else value
                 for key, value in batch.items()}
        rows_, length = batch["input_ids"].shape
        batch["position_ids"] = torch.arange(length).expand(rows_, length).clone()
        return batch


def target_tokens(batch: dict) -> torch.Tensor:
    """Targets of this rank's shard (the adapter has shifted the labels already), a 0-dim tensor where the labels
    are (no wait for the device)."""
    return (batch["shift_labels"] != IGNORE_INDEX).sum()


def target_count(batch: dict) -> int:
    """:func:`target_tokens` as a Python int."""
    return int(target_tokens(batch))


def loss_multiplier(layout: Layout, zero_stage: int | None) -> int:
    """What each rank's shard loss is multiplied by before backward so that DeepSpeed's gradient reduction gives
    the whole batch's gradient. ZeRO-0/1/2 average over the data-parallel ranks and sum over the sp group: the
    data-parallel size. ZeRO-3's reduce-scatter averages over the whole sp x data-parallel group: sp times more
    (measured: tests/train/model/test_sequence_parallel.py, without it ZeRO-3's gradients and their norm are 1/sp;
    the same finding in hamishivi/tmax#9)."""
    return layout.data_parallel_size * (layout.sp if zero_stage == 3 else 1)


def shard_loss(model, batch: dict, num_items_in_batch: torch.Tensor) -> torch.Tensor:
    """This rank's share of the window's loss: its token-loss sum over the window's target count."""
    logits = model(**{key: batch[key] for key in MODEL_KEYS}).logits
    config = getattr(model, "module", model).config  # under DeepSpeed, the engine wraps the transformers model
    return getattr(model, "module", model).loss_function(
        logits=logits, labels=None, shift_labels=batch["shift_labels"].to(logits.device).contiguous(),  # a column slice
        vocab_size=config.vocab_size, num_items_in_batch=num_items_in_batch)


class Batches:
    """The adapter as the loop uses a loader: ``set_epoch`` reaches the loader it wraps; one pass per epoch; and a
    resumed epoch that skips on the loader under the adapter."""

    def __init__(self, adapter):
        self.adapter = adapter

    def set_epoch(self, epoch: int) -> None:
        self.adapter.dl.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.adapter)

    def __iter__(self):
        # One pass: after the StopIteration that ends an epoch the adapter starts its loader again, so a window cut
        # short by the epoch's end would otherwise be followed by the next pass's batches, not by the epoch's end.
        yield from self.adapter

    def resumed(self, accelerator, micro_batches: int):
        """The rest of the epoch after this rank's first `micro_batches` adapter micro-batches (a checkpoint's data
        position). The adapter makes sp micro-batches of each round of loader batches (one from every rank of the sp
        group, in sp-rank order), so: skip whole rounds on the loader it wraps with accelerate's
        ``skip_first_batches`` (indices only, nothing loaded), then drop the round's first micro-batches already
        trained. accelerate's skip cannot be applied to the adapter itself (no sampler, and sp micro-batches per
        loader batch)."""
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        old = self.adapter
        rounds, rest = divmod(micro_batches, old.sp_world_size)
        adapter = UlyssesSPDataLoaderAdapter(accelerator.skip_first_batches(old.dl, rounds), sp_rank=old.sp_rank,
                                             sp_group=old.sp_group, sp_world_size=old.sp_world_size, device=old.device)
        return itertools.islice(Batches(adapter), rest, None)
