"""From tokenized rows to micro-batches: the collator (padded or packed), the shuffling DataLoader every rank
draws its share from, the dataloader workers by default, and the counts a step needs (target tokens, rows per
rank)."""

from __future__ import annotations

from typing import Any

import datasets
import torch
from torch.utils.data import DataLoader, RandomSampler
from transformers import DataCollatorForSeq2Seq

from hf_scale.train.data.labels import IGNORE_INDEX


def make_collator(tokenizer: Any, packing: bool, *, pad_to: int | None = None, varlen_kwargs: bool = False):
    """Collate a list of dataset rows into a dict of tensors for ``model(**batch)``.

    - ``packing=True``: rows packed by hf_scale.train.data.packing, collated by its ``PackedCollator``
      (position ids restarting per example, the first label of every example ignored, rows padded to
      `pad_to` or to the longest row; `varlen_kwargs` adds the ``cu_seq_lens`` of varlen kernels).
      The model must run with ``use_cache=False`` (the Trainer's default; set
      ``model.config.use_cache = False`` in a manual loop): with a cache transformers does not look
      for packed sequences and the examples would attend to each other.
    - ``packing=False``: pad to the longest example; ``attention_mask`` marks the padding and
      padded labels are ``-100``.
    """
    if tokenizer.pad_token is None:
        # Many base-model tokenizers (Llama 3, Mistral) have no pad token. Padded positions are masked
        # out of attention and of the loss, so which id fills them does not matter; eos is always there.
        tokenizer.pad_token = tokenizer.eos_token
    if packing:
        from hf_scale.train.data.packing import PackedCollator

        return PackedCollator(tokenizer.pad_token_id, pad_to=pad_to, varlen_kwargs=varlen_kwargs)
    return DataCollatorForSeq2Seq(
        tokenizer, label_pad_token_id=IGNORE_INDEX, padding="longest", return_tensors="pt"
    )


def make_train_dataloader(
    dataset: datasets.Dataset,
    collator,
    micro_batch_size: int,
    seed: int,
    num_workers: int = 0,
    *,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
) -> DataLoader:
    """A shuffling DataLoader of micro-batches, meant to go through ``accelerator.prepare``.

    Prepare it with ``DataLoaderConfiguration(use_seedable_sampler=True, data_seed=seed)`` and call
    ``dataloader.set_epoch(epoch)`` at the start of every epoch. accelerate then draws one
    permutation per epoch (seed + epoch: same on every rank, different every epoch) and hands whole
    micro-batches round-robin to the ranks, so the ranks see disjoint samples. Pass ``data_seed``
    (or call ``accelerate.utils.set_seed`` on every rank): otherwise accelerate re-seeds this
    sampler from each process's ``torch.initial_seed()``, and ranks with different seeds would
    overlap.

    The tail: nothing is dropped (``drop_last=False``). With accelerate's default
    ``even_batches=True``, when the number of micro-batches is not a multiple of the number of
    ranks, or the last one is short, the last micro-batches are completed with samples from the
    start of the same epoch's order, so every rank runs the same number of full micro-batches and
    up to ``num_processes * micro_batch_size - 1`` samples are seen twice in that epoch.

    The loader flags are the Trainer's (--dataloader_num_workers, --dataloader_pin_memory,
    --dataloader_prefetch_factor, --dataloader_persistent_workers): collation runs in worker processes
    and batches are copied from pinned memory, so the next micro-batch is ready when a step ends.
    """
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=RandomSampler(dataset, generator=generator),
        collate_fn=collator,
        drop_last=False,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        persistent_workers=persistent_workers and num_workers > 0,
    )


def default_dataloader_workers(cuda: bool, local_processes: int, cores: int | None) -> int:
    """--dataloader_num_workers when not given: 2 per GPU process when the cores allow (collation and the
    host-to-device copy overlap the step), none on CPU-only runs (the cores are busy training)."""
    if not cuda:
        return 0
    return max(0, min(2, (cores or 1) // max(1, local_processes) - 1))


def target_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Tokens that contribute to the loss, counted exactly as the Trainer counts ``num_items_in_batch``: a 0-dim
    tensor where the labels are, so that a loop counting every micro-batch does not wait for the device.

    transformers' ``ForCausalLMLoss`` shifts labels left by one (logit ``t`` predicts label ``t+1``),
    so label 0 of each row is never a target: count ``labels[..., 1:] != -100``.
    """
    return (batch["labels"][..., 1:] != IGNORE_INDEX).sum()


def count_target_tokens(batch: dict[str, torch.Tensor]) -> int:
    """:func:`target_tokens` as a Python int."""
    return int(target_tokens(batch))


def micro_batch_per_rank(dataloader, num_processes: int) -> int | None:
    """Rows one rank's micro-batches hold, as accelerate's prepared loader reports them (what the runtime guard
    compares with --per_device_train_batch_size): its total over the ranks, split; None when unknown (a loader
    accelerate did not prepare) or split_batches (the total is one rank's batch cut in pieces)."""
    total = getattr(dataloader, "total_batch_size", None)
    if total is None or getattr(dataloader, "split_batches", False):
        return None
    return total // num_processes
