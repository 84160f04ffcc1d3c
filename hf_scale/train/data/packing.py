"""Packing to a token budget (`--packing`): whole examples into rows of up to `--max_seq_length` tokens.

TRL's convention (``trl.pack_dataset``): the tokenized dataset is shuffled once (seeded), cut into windows
of `--packing_window` examples, and each window is packed by best-fit decreasing (longest example first,
into the open row with the least room that still fits it). Every row keeps its examples whole; a row's
``seq_lengths`` column lists their lengths, from which the collator rebuilds ``position_ids`` (restarting
at 0 per example) and the ``cu_seq_lens`` of variable-length attention kernels. Examples longer than the
budget are truncated (``bfd``, already done by tokenization) or split into budget-sized pieces
(``bfd_split``). `--per_device_train_batch_size` then counts packed rows.

Packing runs through ``datasets.map``, so it is cached next to the tokenized data like tokenization.
TRL implements the same algorithm, but TRL is not a dependency of hf_scale (nor on the GPU images it
runs on) and the algorithm is 30 lines; the names (``bfd``, ``bfd_split``, ``seq_lengths``) are TRL's
so that a TRL user finds what they expect.

Ranks get balanced token counts. BFD alone fills every row of a window to the budget except the last few,
which hold what is left (a row of 1,700 tokens next to rows of 16,384): the rank that draws it idles at the
next collective while the others compute, and every step that holds a full row lasts a full row. So each
window's rows are then evened out (:func:`balanced_rows`): the same examples in as many rows, examples moved
from the fullest rows to the emptiest until every row is close to the window's mean. The windows are cut
equal (1000 examples and a remainder of 3 would leave a row of 3 examples), so windows fill alike. Balance
then holds whichever rows a rank draws: accelerate's and the Trainer's samplers still shuffle the rows every
epoch and deal whole micro-batches round-robin, unchanged, and a rank's tokens per micro-batch are at most
``max row / min row`` times the ranks' mean, the number :func:`packing_summary` prints. The examples and the
loss normalisation (``num_items_in_batch`` over all ranks) do not change; only which examples share a row
does. With `--torch_compile` (or flex_attention) every row is padded to exactly the budget (one shape: one
compilation), so every row costs a full budget in the projections and MLPs whatever it holds. Only the
attention work (quadratic in each example's length) varies with the examples a row holds.
"""

from __future__ import annotations

import bisect
import heapq
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import datasets
import pyarrow.compute
import torch

from hf_scale.errors import UserError
from hf_scale.train.data.labels import IGNORE_INDEX

PACKING_STRATEGIES = ("bfd", "bfd_split")
SEQ_LENGTHS = "seq_lengths"
"""Column of a packed row: the lengths of the examples in it, in order (TRL's name)."""
REAL_TOKEN_MASK = "real_token_mask"
"""Key of a packed micro-batch: 1 for its tokens, 0 for the padding to a fixed row length (``[rows, length]``). Packed
rows carry no ``attention_mask`` (one would turn off transformers' packed-sequence detection), so this is where the
padding is known: the token count of the metrics and the router's load-balancing loss (train/model/router_loss.py) read
it. Not a model input: both loops drop it before the forward pass (:func:`model_inputs`)."""


def best_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Group the indices of `lengths` into bins of total length <= `budget`, by best-fit decreasing.

    Deterministic: ties in length are taken in index order, ties in room by the oldest bin. Every index
    appears exactly once; a length above the budget is an error (truncate or split first).
    """
    bins: list[list[int]] = []
    open_bins: list[tuple[int, int]] = []  # (room left, bin id), sorted: bisect finds the tightest fit
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        if not 0 < length <= budget:
            raise ValueError(f"example {index} has {length} tokens; packing needs 1..{budget}")
        slot = bisect.bisect_left(open_bins, (length, -1))
        if slot == len(open_bins):
            bin_id, room = len(bins), budget
            bins.append([])
        else:
            room, bin_id = open_bins.pop(slot)
        bins[bin_id].append(index)
        if room - length > 0:
            bisect.insort(open_bins, (room - length, bin_id))
    return bins


def balanced_rows(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """As many rows as :func:`best_fit_decreasing` needs, evened out: each close to their mean.

    First the examples are dealt longest first to the row holding the fewest tokens (LPT, the classic greedy
    for equal sums: the shortest, dealt last, settle the differences). When that overflows the budget (a
    few long examples per row and little room left), BFD's rows are the start instead. Then, while it
    evens them, the emptiest row takes from the fullest row that has one the example closest to half the
    gap between the two (shorter than the gap, within the budget): every move lowers the sum of squared
    row loads, so it ends. Deterministic: ties go to the lower row and example index.
    """
    packed = best_fit_decreasing(lengths, budget)
    rows = _dealt(lengths, len(packed), budget) or packed
    loads = [sum(lengths[i] for i in members) for members in rows]
    for _ in range(4 * len(lengths)):  # a safety bound, never reached in practice
        low = min(range(len(rows)), key=lambda row: (loads[row], row))
        move = None
        for high in sorted(range(len(rows)), key=lambda row: (-loads[row], row)):
            gap = loads[high] - loads[low]
            if gap < 2:  # no example is shorter than the gap and still evens the two rows
                break
            fits = [i for i in rows[high] if lengths[i] < gap and loads[low] + lengths[i] <= budget]
            if fits:
                move = high, min(fits, key=lambda i: (abs(2 * lengths[i] - gap), i))
                break
        if move is None:
            return rows
        high, index = move
        rows[high].remove(index)
        rows[low].append(index)
        loads[high] -= lengths[index]
        loads[low] += lengths[index]
    return rows


def _dealt(lengths: Sequence[int], count: int, budget: int) -> list[list[int]] | None:
    """The examples dealt longest first to the emptiest of `count` rows, or None if one overflows the budget."""
    loads = [(0, row) for row in range(count)]  # a heap: the emptiest row first
    rows: list[list[int]] = [[] for _ in range(count)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, row = heapq.heappop(loads)
        if load + lengths[index] > budget:
            return None
        rows[row].append(index)
        heapq.heappush(loads, (load + lengths[index], row))
    return rows


def _split(ids: list[int], labels: list[int], budget: int) -> list[tuple[list[int], list[int]]]:
    return [(ids[i : i + budget], labels[i : i + budget]) for i in range(0, len(ids), budget)]


def _has_target(labels: list[int]) -> bool:
    # The first label of every packed example is ignored (see PackedCollator), so it does not count.
    return any(label != IGNORE_INDEX for label in labels[1:])


def _pack_window(batch: dict[str, list], *, budget: int, split: bool) -> dict[str, list]:
    """One window of tokenized examples -> packed rows (``input_ids``, ``labels``, ``seq_lengths``)."""
    examples = list(zip(batch["input_ids"], batch["labels"], strict=True))
    if split:
        examples = [piece for ids, labels in examples for piece in _split(ids, labels, budget)]
        examples = [(ids, labels) for ids, labels in examples if _has_target(labels)]
    else:
        examples = [(ids[:budget], labels[:budget]) for ids, labels in examples]
    rows: dict[str, list] = {"input_ids": [], "labels": [], SEQ_LENGTHS: []}
    for members in balanced_rows([len(ids) for ids, _ in examples], budget):
        rows["input_ids"].append([t for i in members for t in examples[i][0]])
        rows["labels"].append([t for i in members for t in examples[i][1]])
        rows[SEQ_LENGTHS].append([len(examples[i][0]) for i in members])
    return rows


def pack_dataset(
    tokenized: datasets.Dataset, *, budget: int, strategy: str, window: int, seed: int, num_proc: int | None = None
) -> datasets.Dataset:
    """Shuffle (seeded), cut into equal windows of at most `window` examples, pack each into rows of <= `budget`
    tokens (:func:`balanced_rows`)."""
    if strategy not in PACKING_STRATEGIES:
        raise UserError(f"--packing_strategy {strategy}: unknown; allowed: {', '.join(PACKING_STRATEGIES)}")
    if window < 1:
        raise UserError(f"--packing_window {window}: must be a positive number of examples")
    # The shuffle decides which examples share a window (and so a row): a dataset sorted by source or
    # length would otherwise pack similar neighbours together. The sampler still reshuffles rows per epoch.
    shuffled = tokenized.shuffle(seed=seed)
    # Equal windows: 2,003 examples in windows of 1000 are cut 668/668/667, not 1000/1000/3 (a nearly empty row);
    # with num_proc, datasets cuts the data into that many contiguous shards first, then windows each one.
    shard = math.ceil(len(shuffled) / (num_proc or 1))
    window = math.ceil(shard / math.ceil(shard / window)) if shard else window
    packed = shuffled.map(
        partial(_pack_window, budget=budget, split=strategy == "bfd_split"),
        batched=True,
        batch_size=window,
        remove_columns=tokenized.column_names,
        num_proc=num_proc,
        desc="Packing",
    )
    if len(packed) == 0:
        raise UserError(f"--packing_strategy {strategy}: no example with a target token is left to pack")
    return packed


def packing_summary(examples: int, packed: datasets.Dataset, budget: int) -> str:
    """One line: how many rows, how much of their token budget the examples fill, and how evenly: a rank's tokens
    per micro-batch are at most max row / min row times the ranks' mean, whichever rows the sampler deals it."""
    lengths = pyarrow.compute.list_value_length(packed.data.column("input_ids"))
    tokens = pyarrow.compute.sum(lengths).as_py()
    extremes = pyarrow.compute.min_max(lengths)
    shortest, longest = extremes["min"].as_py(), extremes["max"].as_py()
    return (
        f"packed {examples} examples into {len(packed)} rows of at most {budget} tokens "
        f"({100.0 * tokens / (len(packed) * budget):.1f}% of the budget filled); rows hold {shortest}-{longest} "
        f"tokens: rank imbalance (max/mean tokens per micro-batch over ranks) at most {longest / shortest:.3f}"
    )


def maybe_pack(tokenized: datasets.Dataset, args, *, seed: int, announce: bool = False) -> datasets.Dataset:
    """The training rows: `tokenized` packed to --max_seq_length with --packing, else unchanged."""
    if not args.packing:
        return tokenized
    packed = pack_dataset(
        tokenized,
        budget=args.max_seq_length,
        strategy=args.packing_strategy,
        window=args.packing_window,
        seed=seed,
        num_proc=args.preprocessing_num_workers,
    )
    if announce:
        print(f"hf_scale: {packing_summary(len(tokenized), packed, args.max_seq_length)}", file=sys.stderr, flush=True)
    return packed


@dataclass
class PackedCollator:
    """Packed rows -> a micro-batch ``[rows, length]`` for ``model(**batch)``.

    - ``position_ids`` restart at 0 for every example: transformers then keeps examples from attending
      to each other (a block-diagonal mask for sdpa/eager/flex; ``cu_seq_lens`` for varlen kernels).
    - The first label of every example is -100, so no example is trained to predict the next one's
      first token (what ``DataCollatorWithFlattening`` does).
    - Rows are padded to `pad_to` tokens (fixed shapes for torch.compile) or to the longest row. Padding
      is one more "example" per row: its own positions, labels -100, attending only to itself.
    - `varlen_kwargs`: also ``cu_seq_lens_q/k`` (int32, over the flattened micro-batch) and
      ``max_length_q/k`` (Python ints, computed here on the CPU so no kernel waits for a device sync),
      which transformers hands to flash-attention and hf_scale's ``torch_varlen`` attention.
    - ``real_token_mask``: 1 for tokens, 0 for padding (the metrics' token count and the router's load-balancing
      loss; dropped before the forward pass).

    Rows without ``seq_lengths`` (an unpacked validation set) are one example each.
    """

    pad_token_id: int
    pad_to: int | None = None
    varlen_kwargs: bool = False

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor | int]:
        width = self.pad_to or max(len(row["input_ids"]) for row in rows)
        input_ids, labels, positions, segments = [], [], [], []
        for row in rows:
            # A row of an unpacked dataset (the validation set) is one example.
            lengths = list(row[SEQ_LENGTHS]) if SEQ_LENGTHS in row else [len(row["input_ids"])]
            padding = width - len(row["input_ids"])
            if padding < 0:
                raise ValueError(f"a packed row of {len(row['input_ids'])} tokens does not fit in {width}")
            row_labels = list(row["labels"])
            start = 0
            for length in lengths:
                row_labels[start] = IGNORE_INDEX
                start += length
            input_ids.append(list(row["input_ids"]) + [self.pad_token_id] * padding)
            labels.append(row_labels + [IGNORE_INDEX] * padding)
            positions.append([p for length in lengths for p in range(length)] + list(range(padding)))
            segments += lengths + ([padding] if padding else [])
        batch: dict[str, torch.Tensor | int] = {
            "input_ids": torch.tensor(input_ids, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
            "position_ids": torch.tensor(positions, dtype=torch.long),
            REAL_TOKEN_MASK: torch.tensor([[1] * len(row["input_ids"]) + [0] * (width - len(row["input_ids"]))
                                           for row in rows], dtype=torch.long),
        }
        if self.varlen_kwargs:
            cu_seq_lens = torch.tensor([0] + segments, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            batch.update(
                cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens,
                max_length_q=max(segments), max_length_k=max(segments),
            )  # fmt: skip
        return batch


def model_inputs(batch: dict) -> dict:
    """The micro-batch without hf_scale's bookkeeping keys: what ``model(**...)`` receives."""
    return {key: value for key, value in batch.items() if key != REAL_TOKEN_MASK}
