"""Context parallelism (cp > 1, strategy fsdp with FSDP2) in both loops, accelerate's recipe.

Each rank of a cp group holds 1/cp of every sequence. The Accelerator gets
``ParallelismConfig(dp_replicate, dp_shard, cp, cp_handler=TorchContextParallelConfig(cp_comm_strategy))``: FSDP2
shards over ``dp_shard x cp`` (accelerate's ``dp_shard_cp`` mesh dimension), the data loader is split over the
data-parallel ranks only (``process_index // (tp * cp)``), and ``prepare`` hooks every ``self_attn`` to drop the
attention mask for ``is_causal=True``. Each micro-batch's forward and backward then run inside
``accelerator.maybe_context_parallel(buffers, buffer_seq_dims, no_restore_buffers)``: torch's ``context_parallel``
cuts each buffer's sequence into 2 x cp chunks (rank i keeps chunks i and 2cp-1-i, which balances the causal work)
and replaces SDPA with ring attention over the cp group. The manual loop does this in :func:`sharded`; the HF
Trainer does it itself (``Trainer._prepare_context_parallel_inputs``) once its Accelerator has the config.

What that asks of a batch (:class:`Collator`): padding on the right (the mask is dropped, so a real token must never
follow a pad), a length that is a multiple of 2 x cp (padded to it, labels -100), ``position_ids`` (each chunk keeps
its global positions for the rotary embedding) and ``shift_labels`` (the targets shifted before sharding: a chunk's
last token predicts the next chunk's first). Packed rows would need a document mask, which ring attention cannot
apply: refused.

The loss (the Trainer's rule, and the manual loop's): the window's targets are counted before sharding, summed over
all ranks and divided by tp x cp (the ranks of a cp group hold the same batch then); each rank's loss is its
chunks' token-loss sum over that count, times dp x cp (FSDP2 averages the gradients over dp_replicate x dp_shard
x cp, the Trainer's ``num_processes // tp``), so the cp group's summed gradients are the whole sequences'.

Ring attention has no CPU kernel (parallelism.train_refusal): on CPU this module's pieces are proven up to it
(tests/train/model/test_context_parallel.py); the cp=2 run against one process is benchmarks/gpu_cp.py.
"""

from __future__ import annotations

import contextlib

import torch

from hf_scale.config.parallelism import Layout
from hf_scale.train.data.labels import IGNORE_INDEX

BUFFER_KEYS = ("input_ids", "labels", "shift_labels", "attention_mask", "position_ids")
"""The batch's tensors with a sequence dimension (1) that are sharded with it, in this order."""


def accelerate_config(layout: Layout, cp_comm_strategy: str = "allgather"):
    """The Accelerator's ``parallelism_config`` for this layout (None without cp)."""
    if layout.cp <= 1:
        return None
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import TorchContextParallelConfig

    return ParallelismConfig(dp_replicate_size=layout.dp_replicate, dp_shard_size=layout.dp_shard,
                             cp_size=layout.cp, cp_backend="torch",
                             cp_handler=TorchContextParallelConfig(cp_comm_strategy=cp_comm_strategy))


def collator(inner, layout: Layout, tokenizer):
    """The cp collator around the run's, or a one-line refusal of a tokenizer that pads on the left."""
    from hf_scale.errors import UserError

    if tokenizer.padding_side != "right":
        raise UserError(f"parallelism.cp={layout.cp}: the tokenizer pads on the {tokenizer.padding_side}; context "
                        "parallelism drops the attention mask (causal attention only), so padding must be on the right")
    return Collator(inner, layout.cp, tokenizer.pad_token_id)


class Collator:
    """The run's collator, then what context parallelism needs: rows padded on the right to a multiple of 2 x cp,
    ``position_ids`` and ``shift_labels``."""

    def __init__(self, inner, cp: int, pad_token_id: int):
        self.inner, self.multiple, self.pad_token_id = inner, 2 * cp, pad_token_id

    def __call__(self, rows):
        batch = self.inner(rows)
        extra = -batch["input_ids"].shape[1] % self.multiple
        fills = {"input_ids": self.pad_token_id, "labels": IGNORE_INDEX, "attention_mask": 0}
        batch = {key: torch.nn.functional.pad(value, (0, extra), value=fills[key]) if key in fills else value
                 for key, value in batch.items()}
        rows_, length = batch["input_ids"].shape
        batch["position_ids"] = torch.arange(length).expand(rows_, length).clone()
        batch["shift_labels"] = torch.nn.functional.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:].contiguous()
        return batch


def buffers(batch: dict) -> list[torch.Tensor]:
    """The tensors context parallelism shards, all along dimension 1."""
    return [batch[key] for key in BUFFER_KEYS if torch.is_tensor(batch.get(key))]


def sharded(accelerator, batch: dict, layout: Layout):
    """The context in which one micro-batch's forward and backward run: with cp > 1 the batch's buffers are sharded
    in place and stay sharded (counts are taken before), attention is ring attention; otherwise nothing."""
    if layout.cp <= 1:
        return contextlib.nullcontext()
    tensors = buffers(batch)
    return accelerator.maybe_context_parallel(buffers=tensors, buffer_seq_dims=[1] * len(tensors),
                                              no_restore_buffers=set(tensors))


def loss_multiplier(layout: Layout, data_parallel_size: int) -> int:
    """What each rank's loss (its chunks' token-loss sum over the window's targets) is multiplied by before backward:
    the data-parallel size, times cp (FSDP2 averages the gradients over the cp ranks too)."""
    return data_parallel_size * layout.cp
