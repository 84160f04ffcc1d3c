"""Packing to a token budget (hf_scale.train.data.packing), attention selection and the varlen attention function
(hf_scale.train.model.attention), the --use_liger_kernel preflight (hf_scale.train.model.liger).

The per-token loss of packed rows is proven against separate forward passes of the same examples with every
attention implementation that runs on a CPU: sdpa and eager (forward and backward), flex_attention (forward
only: PyTorch has no FlexAttention backward on CPU) and hf_scale's ``torch_varlen`` function. The last one
calls ``torch.nn.attention.varlen.varlen_attn``, whose flash kernel exists only for CUDA; here it runs with
``reference_varlen``, the kernel's documented contract computed per example with sdpa, so what is proven on
CPU is hf_scale's part (layout, grouped-query heads, cu_seq_lens, registration in transformers); the kernel
itself runs in ``benchmarks/gpu.py`` on a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import statistics
from pathlib import Path

import datasets
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_scale.contract.data_arguments import DataArguments
from hf_scale.contract.embedded_assets import EMBEDDED_MODEL_DIR
from hf_scale.errors import UserError
from hf_scale.train.data.batches import make_collator
from hf_scale.train.data.labels import IGNORE_INDEX
from hf_scale.train.data.packing import (
    REAL_TOKEN_MASK,
    SEQ_LENGTHS,
    PackedCollator,
    balanced_rows,
    best_fit_decreasing,
    model_inputs,
    pack_dataset,
    packing_summary,
)
from hf_scale.train.data.pipeline import load_raw_datasets, tokenize_dataset
from hf_scale.train.loops.metrics import count_real_tokens
from hf_scale.train.model import attention
from hf_scale.train.model.liger import liger_problem


@pytest.fixture(autouse=True)
def datasets_cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets_cache"))


# --- best-fit decreasing ------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [16, 100, 512])
def test_bfd_places_every_example_once_and_no_row_over_the_budget(budget):
    rng = random.Random(budget)
    lengths = [rng.randint(1, budget) for _ in range(300)]
    bins = best_fit_decreasing(lengths, budget)
    assert sorted(i for members in bins for i in members) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in members) for members in bins]
    assert max(loads) <= budget
    # Best fit never opens a row while an open one has room: at most one row is half empty or worse.
    assert sum(load <= budget // 2 for load in loads) <= 1
    assert best_fit_decreasing(lengths, budget) == bins  # deterministic


def test_bfd_takes_the_tightest_row_and_keeps_long_examples_first():
    # 6 opens row 0; 5 opens row 1; 4 -> row 0 (room 4, exactly), 3 -> row 1 (room 5), 2 -> row 1.
    assert best_fit_decreasing([2, 5, 3, 6, 4], 10) == [[3, 4], [1, 2, 0]]
    with pytest.raises(ValueError, match="packing needs 1..10"):
        best_fit_decreasing([11], 10)


def test_balanced_rows_even_out_bfd_rows_without_adding_one():
    rng = random.Random(0)
    lengths = [rng.randint(1, 300) for _ in range(400)]
    rows = balanced_rows(lengths, 2000)
    assert sorted(i for members in rows for i in members) == list(range(len(lengths)))
    assert len(rows) == len(best_fit_decreasing(lengths, 2000)) == 30, "as many rows as best-fit decreasing"
    loads = [sum(lengths[i] for i in members) for members in rows]
    assert max(loads) <= 2000 and max(loads) - min(loads) < 20, "within a few short examples of each other"
    bfd_loads = [sum(lengths[i] for i in members) for members in best_fit_decreasing(lengths, 2000)]
    assert max(bfd_loads) - min(bfd_loads) > 1000, "best-fit decreasing alone leaves a short last row"
    assert balanced_rows(lengths, 2000) == rows  # deterministic


def test_balanced_rows_even_out_bfd_rows_when_dealing_overflows():
    # Dealt longest first to the emptiest of 3 rows: 8|5|4, 8|5+3|4+4, then 3 fits nowhere. BFD's rows hold 8, 10
    # and 10 tokens; the 1-token example moves from the second row to the first: 9, 9, 10.
    lengths = [4, 8, 3, 4, 5, 3, 1]
    assert best_fit_decreasing(lengths, 10) == [[1], [4, 0, 6], [3, 2, 5]]
    assert balanced_rows(lengths, 10) == [[1, 6], [4, 0], [3, 2, 5]]
    assert balanced_rows([3, 3, 2, 2, 2], 6) == [[0, 1], [2, 3, 4]], "full rows stay as they are"


def _instruction_lengths(count: int, seed: int = 0) -> list[int]:
    """benchmarks/gpu.py's data: log-normal prompt (median 160) and response (median 240) tokens, cut at 2,048."""
    rng = random.Random(seed)

    def draw(median: float, sigma: float, least: int) -> int:
        return max(least, round(rng.lognormvariate(math.log(median), sigma)))

    return [min(2048, draw(160, 0.8, 16) + draw(240, 1.0, 8) + 2) for _ in range(count)]


def _rank_imbalance(row_tokens: list[int], *, world: int, micro: int, epochs: int = 3) -> list[float]:
    """max/mean tokens over ranks of every micro-step, rows dealt as both loops deal them: a seeded RandomSampler
    reshuffling each epoch, whole micro-batches round-robin to the ranks (accelerate's BatchSamplerShard)."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, RandomSampler

    ratios = []
    for epoch in range(epochs):
        shards = []
        for rank in range(world):
            order = RandomSampler(row_tokens, generator=torch.Generator().manual_seed(epoch))
            shards.append(BatchSamplerShard(BatchSampler(order, micro, drop_last=False), world, rank))
        for step in zip(*shards, strict=True):
            tokens = [sum(row_tokens[i] for i in batch) for batch in step]
            ratios.append(max(tokens) * world / sum(tokens))
    return ratios


@pytest.mark.parametrize(("world", "micro", "budget", "bound"),
                         [(2, 1, 16_384, 1.035), (8, 1, 16_384, 1.035), (8, 2, 16_384, 1.035), (8, 4, 2048, 1.07)])
def test_ranks_get_balanced_token_counts_on_instruction_lengths(world, micro, budget, bound, capsys):
    lengths, window = _instruction_lengths(20_000), 1000
    ordered = sorted(lengths)
    assert 560 < statistics.mean(lengths) < 640 and 1100 < ordered[int(0.9 * len(ordered))] < 1250

    def row_tokens(pack) -> list[int]:
        windows = [lengths[start : start + window] for start in range(0, len(lengths), window)]
        return [sum(part[i] for i in members) for part in windows for members in pack(part, budget)]

    before, after = row_tokens(best_fit_decreasing), row_tokens(balanced_rows)
    assert len(after) == len(before) and sum(after) == sum(before) == sum(lengths)
    imbalance_before = _rank_imbalance(before, world=world, micro=micro)
    imbalance = _rank_imbalance(after, world=world, micro=micro)
    worst_before, worst_after = max(imbalance_before), max(imbalance)
    with capsys.disabled():
        print(f"\n{world} ranks x {micro} rows of {budget} tokens, max/mean tokens per micro-step over ranks: worst "
              f"{worst_before:.3f}, mean {statistics.mean(imbalance_before):.4f} (best-fit decreasing) -> worst "
              f"{worst_after:.3f}, mean {statistics.mean(imbalance):.4f} (balanced)")
    assert worst_after <= max(after) / min(after) <= bound, "the bound packing_summary prints holds"
    assert worst_after < 1.02 < 1.04 < worst_before


def test_the_startup_line_says_the_rank_imbalance_bound():
    packed = pack_dataset(_numbered([5, 9, 3, 7, 8, 2, 6, 4] * 4), budget=16, strategy="bfd", window=1000, seed=0)
    row_tokens = [len(ids) for ids in packed["input_ids"]]
    line = packing_summary(32, packed, 16)
    assert f"rows hold {min(row_tokens)}-{max(row_tokens)} tokens" in line
    assert line.endswith(f"at most {max(row_tokens) / min(row_tokens):.3f}") and "\n" not in line


def _numbered(lengths: list[int]) -> datasets.Dataset:
    """Example i is `lengths[i]` copies of token 10 + i (so a row tells which examples it holds)."""
    rows = [[10 + i] * n for i, n in enumerate(lengths)]
    return datasets.Dataset.from_dict({"input_ids": rows, "labels": rows})


def _members(row: dict) -> list[int]:
    starts = [0]
    for length in row[SEQ_LENGTHS][:-1]:
        starts.append(starts[-1] + length)
    return [row["input_ids"][start] - 10 for start in starts]


def test_packing_shuffles_then_packs_each_window_and_is_deterministic():
    lengths = [random.Random(7).randint(2, 40) for _ in range(60)]
    dataset = _numbered(lengths)
    packed = pack_dataset(dataset, budget=64, strategy="bfd", window=16, seed=3)
    rows = list(packed)
    assert sorted(i for row in rows for i in _members(row)) == list(range(60)), "every example exactly once"
    for row in rows:
        assert len(row["input_ids"]) == sum(row[SEQ_LENGTHS]) <= 64
        assert row["input_ids"] == [10 + i for i in _members(row) for _ in range(lengths[i])]
    # A row only holds examples of one window of the seeded shuffle; 60 examples in windows of at most 16 are
    # cut into 4 equal windows of 15 (not 16/16/16/12).
    order = [ids[0] - 10 for ids in dataset.shuffle(seed=3)["input_ids"]]
    windows = [set(order[start : start + 15]) for start in range(0, 60, 15)]
    assert all(any(set(_members(row)) <= window for window in windows) for row in rows)
    assert list(pack_dataset(dataset, budget=64, strategy="bfd", window=16, seed=3)) == rows
    other = [sorted(_members(row)) for row in pack_dataset(dataset, budget=64, strategy="bfd", window=16, seed=4)]
    assert other != [sorted(_members(row)) for row in rows], "another seed packs other neighbours together"


def test_long_examples_are_truncated_by_bfd_and_split_by_bfd_split():
    dataset = _numbered([25, 3])
    truncated = list(pack_dataset(dataset, budget=10, strategy="bfd", window=100, seed=0))
    assert sorted(length for row in truncated for length in row[SEQ_LENGTHS]) == [3, 10]
    split = list(pack_dataset(dataset, budget=10, strategy="bfd_split", window=100, seed=0))
    assert sorted(length for row in split for length in row[SEQ_LENGTHS]) == [3, 5, 10, 10]
    assert sum(row["input_ids"].count(10) for row in split) == 25, "every token of the long example kept"
    with pytest.raises(UserError, match="--packing_strategy wrapped: unknown; allowed: bfd, bfd_split"):
        pack_dataset(dataset, budget=10, strategy="wrapped", window=100, seed=0)


def test_packing_is_cached_like_tokenization(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"example number {i} " * (1 + i % 7)}) + "\n" for i in range(40)))
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    args = DataArguments(train_file=str(path), max_seq_length=128)
    tokenized = tokenize_dataset(load_raw_datasets(args)["train"], tokenizer, args)

    def pack(**changes):
        return pack_dataset(tokenized, **{"budget": 128, "strategy": "bfd", "window": 1000, "seed": 0, **changes})

    first, again = pack(), pack()
    assert first.cache_files == again.cache_files and Path(first.cache_files[0]["filename"]).is_relative_to(tmp_path)
    assert pack(budget=96)._fingerprint != first._fingerprint != pack(seed=1)._fingerprint


# --- the collator --------------------------------------------------------------------------------


def test_collator_restarts_positions_ignores_first_labels_pads_and_counts_real_tokens():
    rows = [
        {"input_ids": [5, 6, 7, 8, 9], "labels": [5, 6, 7, 8, 9], SEQ_LENGTHS: [3, 2]},
        {"input_ids": [1, 2, 3], "labels": [-100, 2, 3], SEQ_LENGTHS: [3]},
    ]
    batch = PackedCollator(pad_token_id=0, pad_to=8, varlen_kwargs=True)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [1, 2, 3, 0, 0, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 0, 1, 2, 3, 4]]
    ignored = IGNORE_INDEX
    assert batch["labels"].tolist() == [[ignored, 6, 7, ignored, 9, ignored, ignored, ignored],
                                        [ignored, 2, 3, ignored, ignored, ignored, ignored, ignored]]
    # Over the flattened micro-batch; the padding of each row is one more segment.
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 8, 11, 16] and batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == batch["max_length_k"] == 5
    assert batch[REAL_TOKEN_MASK].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]
    assert count_real_tokens(batch) == 8 and set(model_inputs(batch)) == set(batch) - {REAL_TOKEN_MASK}
    unpadded = PackedCollator(pad_token_id=0)(rows)
    assert unpadded["input_ids"].shape == (2, 5) and "cu_seq_lens_q" not in unpadded


# --- per-token loss of packed rows equals the examples run one by one ----------------------------


def reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                     enable_gqa=False):
    """What torch.nn.attention.varlen.varlen_attn computes (its docstring), example by example with sdpa."""
    assert window_size == (-1, 0), "hf_scale asks for causal attention"
    assert torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32 and cu_seq_q[-1] == query.shape[0]
    assert max_q == max_k == int(cu_seq_q.diff().max())
    out = torch.empty_like(query)
    bounds = cu_seq_q.tolist()
    for start, end in zip(bounds, bounds[1:], strict=False):
        q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))
        out[start:end] = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
        ).transpose(0, 1)
    return out


def reference_varlen_torch_2_9(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False,
                               scale=None):
    """The first varlen_attn signature (is_causal, no grouped-query heads)."""
    assert is_causal and key.shape[1] == query.shape[1]
    return reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=(-1, 0))


@contextlib.contextmanager
def varlen_kernel(function):
    """torch_varlen registered with `function` as its kernel, and the previous registration restored after."""
    from transformers import AttentionInterface

    before = AttentionInterface._global_mapping.get(attention.TORCH_VARLEN)
    attention.register_torch_varlen(function)
    try:
        yield
    finally:
        if before is None:
            AttentionInterface._global_mapping.pop(attention.TORCH_VARLEN, None)
        else:
            AttentionInterface._global_mapping[attention.TORCH_VARLEN] = before


@pytest.fixture(scope="module")
def packed_rows():
    """Seven embedded-sample examples of very different lengths (the longest among them), in two packed rows."""
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    args = DataArguments()
    dataset = tokenize_dataset(load_raw_datasets(args)["train"], tokenizer, args)
    by_length = sorted(range(len(dataset)), key=lambda i: len(dataset[i]["input_ids"]))
    examples = [dataset[i] for i in (by_length[0], by_length[40], by_length[-1], by_length[100], by_length[3],
                                     by_length[200], by_length[150])]

    def row(members):
        return {
            "input_ids": [t for e in members for t in e["input_ids"]],
            "labels": [t for e in members for t in e["labels"]],
            SEQ_LENGTHS: [len(e["input_ids"]) for e in members],
        }

    return examples, [row(examples[:3]), row(examples[3:])], tokenizer


def _model(attn_implementation: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, attn_implementation=attn_implementation)
    model.config.use_cache = False  # as in training (hf_scale.train.model.load.load_model)
    return model.eval()


def _own_logits_and_per_token_loss(model, examples):
    logits, loss_sum, targets = [], 0.0, 0
    with torch.no_grad():
        for example in examples:
            own = model(input_ids=torch.tensor([example["input_ids"]])).logits[0]
            labels = torch.tensor(example["labels"])
            loss_sum += F.cross_entropy(own[:-1], labels[1:], ignore_index=IGNORE_INDEX, reduction="sum")
            targets += int((labels[1:] != IGNORE_INDEX).sum())
            logits.append(own)
    return logits, loss_sum / targets


IMPLEMENTATIONS = ["sdpa", "eager", "flex_attention", "torch_varlen", "torch_varlen_2_9", "torch_varlen_positions"]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_packed_rows_give_each_example_its_own_logits_and_the_same_per_token_loss(packed_rows, implementation):
    examples, rows, tokenizer = packed_rows
    kernels = {"torch_varlen": reference_varlen, "torch_varlen_2_9": reference_varlen_torch_2_9,
               "torch_varlen_positions": reference_varlen}
    with varlen_kernel(kernels.get(implementation, reference_varlen)):
        model = _model(attention.TORCH_VARLEN if implementation in kernels else implementation)
        # "torch_varlen_positions": no cu_seq_lens from the collator; the function derives them from positions.
        collate = make_collator(tokenizer, packing=True, pad_to=512,
                                varlen_kwargs=implementation in ("torch_varlen", "torch_varlen_2_9"))
        batch = collate(rows)
        with torch.no_grad():
            packed = model(**model_inputs(batch))
            want_logits, want_loss = _own_logits_and_per_token_loss(_model("sdpa"), examples)
    torch.testing.assert_close(packed.loss, want_loss, rtol=1e-5, atol=0)
    spans = [(r, sum(row[SEQ_LENGTHS][:k])) for r, row in enumerate(rows) for k in range(len(row[SEQ_LENGTHS]))]
    for (r, start), want in zip(spans, want_logits, strict=True):
        # No attention across examples (nor with the padding): each example's packed logits are its own.
        torch.testing.assert_close(packed.logits[r, start : start + want.shape[0]], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("implementation", ["sdpa", "torch_varlen"])
def test_gradients_of_a_packed_micro_batch_equal_the_examples_one_by_one(packed_rows, implementation):
    """What training uses: the summed token loss over the window's target count, and its gradient."""
    examples, rows, tokenizer = packed_rows
    with varlen_kernel(reference_varlen):
        packed_model, separate_model = _model(implementation), _model("sdpa")
        batch = make_collator(tokenizer, packing=True, varlen_kwargs=implementation == "torch_varlen")(rows)
        targets = torch.tensor(sum(int((torch.tensor(e["labels"][1:]) != IGNORE_INDEX).sum()) for e in examples))
        packed_model(**model_inputs(batch), num_items_in_batch=targets).loss.backward()
    for example in examples:
        ids, labels = torch.tensor([example["input_ids"]]), torch.tensor([example["labels"]])
        separate_model(input_ids=ids, labels=labels, num_items_in_batch=targets).loss.backward()
    for (name, got), want in zip(packed_model.named_parameters(), separate_model.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.skipif(attention._torch_varlen_kernel() is None, reason="this torch has no torch.nn.attention.varlen")
def test_torch_varlen_registers_pytorchs_kernel_in_transformers():
    """The registration path with the real kernel (which only runs on CUDA): transformers accepts the name,
    and the function calls varlen_attn causally, with its own grouped-query support when it has it."""
    from torch.nn.attention.varlen import varlen_attn
    from transformers import AttentionInterface

    with varlen_kernel(None):
        model = _model(attention.TORCH_VARLEN)
        registered = AttentionInterface._global_mapping[attention.TORCH_VARLEN]
    assert model.config._attn_implementation == attention.TORCH_VARLEN
    kernel = registered.keywords["kernel"]
    assert kernel.function is varlen_attn and kernel.causal == {"window_size": (-1, 0)} and kernel.grouped_query


def test_varlen_function_hands_the_kernel_half_precision_under_autocast():
    seen = []

    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
               enable_gqa=False):
        seen.append((query.dtype, key.dtype, enable_gqa))
        return reference_varlen(query.float(), key.float(), value.float(), cu_seq_q, cu_seq_k, max_q, max_k,
                                scale=scale, window_size=window_size, enable_gqa=enable_gqa).to(query.dtype)

    query = torch.randn(1, 4, 6, 8)  # [batch, heads, length, head_dim], fp32 as rotary embeddings leave it
    key = value = torch.randn(1, 2, 6, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention.torch_varlen_attention_forward(
            torch.nn.Module(), query, key, value, None, cu_seq_lens_q=cu, max_length_q=4,
            kernel=attention.VarlenKernel.of(kernel),
        )
    assert out.shape == (1, 6, 4, 8) and out.dtype == torch.bfloat16
    assert seen == [(torch.bfloat16, torch.bfloat16, True)]


# --- choosing the attention implementation -------------------------------------------------------

CPU = attention.AttentionEnvironment(cuda=False, half_precision=False, hopper=False, flash_attn_2=False,
                                     flash_attn_3=False, torch_varlen=True, flex_attention=True)
H100_BF16 = dataclasses.replace(CPU, cuda=True, hopper=True, half_precision=True)


@pytest.mark.parametrize(
    ("env", "packing", "expected"),
    [
        (CPU, True, "sdpa"),
        (CPU, False, "sdpa"),
        (H100_BF16, True, "torch_varlen"),
        (H100_BF16, False, "sdpa"),
        (dataclasses.replace(H100_BF16, half_precision=False), True, "flex_attention"),
        (dataclasses.replace(H100_BF16, torch_varlen=False), True, "flex_attention"),
        (dataclasses.replace(H100_BF16, flash_attn_2=True), True, "flash_attention_2"),
        (dataclasses.replace(H100_BF16, flash_attn_2=True), False, "flash_attention_2"),
        (dataclasses.replace(H100_BF16, flash_attn_2=True, flash_attn_3=True), True, "flash_attention_3"),
        (dataclasses.replace(H100_BF16, flash_attn_3=True, hopper=False), True, "torch_varlen"),
    ],
)
def test_auto_picks_the_fastest_kernel_that_runs_here(env, packing, expected):
    chosen, why = attention.choose("auto", packing=packing, env=env)
    assert chosen == expected and why.startswith("auto: ")


def test_auto_says_why_it_fell_back_to_sdpa():
    _, why = attention.choose("auto", packing=True, env=CPU)
    assert why == ("auto: flash_attention_3 needs the flash_attn_interface package, flash_attention_2 needs the "
                   "flash_attn package, torch_varlen needs a CUDA GPU, flex_attention needs a CUDA GPU")


@pytest.mark.parametrize(
    ("requested", "env", "packing", "fragment"),
    [
        ("torch_varlen", CPU, True, "needs a CUDA GPU, bf16/fp16 (--bf16, --fp16 or --torch_dtype bfloat16)"),
        ("torch_varlen", H100_BF16, False, "needs --packing"),
        ("flash_attention_2", H100_BF16, True, "needs the flash_attn package"),
        ("flex_attention", CPU, True, "needs a CUDA GPU (no backward pass on CPU)"),
        ("flash_attention_3", dataclasses.replace(H100_BF16, flash_attn_3=True, hopper=False), True,
         "needs a Hopper GPU"),
    ],
)
def test_an_explicit_kernel_that_cannot_run_here_is_a_one_line_error(requested, env, packing, fragment):
    with pytest.raises(UserError) as info:
        attention.choose(requested, packing=packing, env=env)
    assert str(info.value).startswith(f"--attn_implementation {requested}: ") and fragment in str(info.value)
    assert "\n" not in str(info.value)
    assert attention.choose("sdpa", packing=packing, env=env) == ("sdpa", "requested")


# --- liger ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("installed", "cuda", "fragment"),
    [
        (False, False, 'needs the liger-kernel package (pip install "hf-scale[gpu]") and a CUDA GPU'),
        (False, True, 'needs the liger-kernel package (pip install "hf-scale[gpu]"); drop the flag'),
        (True, False, "needs a CUDA GPU (its Triton kernels do not run on CPU)"),
    ],
)
def test_liger_without_its_package_or_a_gpu_is_one_line(installed, cuda, fragment):
    problem = liger_problem(use_liger=True, config=None, installed=installed, cuda=cuda, zero_stage=None)
    assert problem.startswith("--use_liger_kernel: ") and fragment in problem and "\n" not in problem
    assert liger_problem(use_liger=False, config=None, installed=installed, cuda=cuda, zero_stage=3) is None


def test_liger_fused_cross_entropy_is_refused_under_zero3_unless_configured_off():
    ready = {"use_liger": True, "installed": True, "cuda": True}
    assert "ZeRO-3" in liger_problem(config=None, zero_stage=3, **ready)
    assert liger_problem(config=None, zero_stage=2, **ready) is None
    assert liger_problem(config={"fused_linear_cross_entropy": False, "cross_entropy": True}, zero_stage=3,
                         **ready) is None


def test_liger_kernel_config_parses_from_the_command_line():
    # transformers types it as `dict`, which argparse cannot build from a string; train.py reads JSON.
    from hf_scale.contract.parser import build_parser

    config = '{"fused_linear_cross_entropy": false, "cross_entropy": true}'
    namespace, _ = build_parser().parse_known_args(["--liger_kernel_config", config])
    assert namespace.liger_kernel_config == {"fused_linear_cross_entropy": False, "cross_entropy": True}
    with pytest.raises(UserError, match="--liger_kernel_config.*not a JSON object"):
        build_parser().parse_known_args(["--liger_kernel_config", "[1]"])


# --- liger: both loops apply the same kernels, configured by --liger_kernel_config ------------------
# liger's kernels run only on a CUDA GPU, but applying them patches modules and functions, which runs anywhere:
# no forward pass here. liger-kernel pulls triton (~1 GB installed), so it is not in the `test` extra.

STOCK = dict.fromkeys(("rms_norm", "swiglu", "rope", "fused_linear_cross_entropy", "cross_entropy"), "stock")
LIGER_RUNS = [
    # (--liger_kernel_config, what is liger's afterwards): None is liger's defaults for Llama.
    (None, {**STOCK, "rms_norm": "liger", "swiglu": "liger", "rope": "liger", "fused_linear_cross_entropy": "liger"}),
    ('{"swiglu": false, "rope": false, "fused_linear_cross_entropy": false, "cross_entropy": true}',
     {**STOCK, "rms_norm": "liger", "cross_entropy": "liger"}),
]


@pytest.fixture
def liger_undone(monkeypatch):
    """liger patches transformers' Llama module and torch's cross_entropy for the whole process: put them back."""
    pytest.importorskip("liger_kernel", reason='liger-kernel is not installed (pip install "hf-scale[gpu]")')
    from accelerate.state import AcceleratorState
    from transformers.models.llama import modeling_llama

    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    monkeypatch.setattr(modeling_llama.LlamaForCausalLM, "forward", modeling_llama.LlamaForCausalLM.forward)
    monkeypatch.setattr(F, "cross_entropy", F.cross_entropy)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _kernels(model) -> dict[str, str]:
    """Which parts of a Llama run liger's code ("liger"), transformers'/torch's ("stock"), or both ("mixed")."""
    from transformers.models.llama import modeling_llama

    def origin(*functions) -> str:
        kinds = {"liger" if f.__module__.startswith("liger_kernel") else "stock" for f in functions}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    norms = [m for name, m in model.named_modules() if name.endswith("norm")]
    mlps = [m for name, m in model.named_modules() if name.endswith("mlp")]
    assert len(norms) == 5 and len(mlps) == 2, "the tiny Llama: 2 layers of 2 norms, and the final norm"
    return {
        "rms_norm": origin(*(m.forward.__func__ for m in norms)),
        "swiglu": origin(*(m.forward.__func__ for m in mlps)),
        "rope": origin(modeling_llama.apply_rotary_pos_emb),
        "fused_linear_cross_entropy": origin(model.forward.__func__),
        "cross_entropy": origin(F.cross_entropy),
    }


def _liger_arguments(config: str | None, tmp_path):
    """TrainingArguments as train.py builds them from its command line, in a single CPU process."""
    from accelerate import PartialState

    from hf_scale.contract.parser import build_parser
    from hf_scale.train.prepare import _training_arguments

    PartialState(cpu=True)  # train.py's process state (distributed.init_process_state), which the arguments reuse

    argv = ["--use_liger_kernel", "--output_dir", str(tmp_path / "out"), "--report_to", "none", "--max_steps", "1"]
    namespace, _ = build_parser().parse_known_args(argv + (["--liger_kernel_config", config] if config else []))
    return _training_arguments(namespace)


class _StopBeforeTheFirstStep(Exception):
    pass


@pytest.mark.parametrize(("config", "expected"), LIGER_RUNS, ids=["defaults", "configured"])
@pytest.mark.parametrize("loop", ["accelerate", "trainer"])
def test_both_loops_apply_liger_with_the_same_configuration(loop, config, expected, liger_undone, tmp_path):
    from accelerate import Accelerator
    from transformers import Trainer, TrainerCallback

    from hf_scale.train.loops import manual as manual_loop

    args = _liger_arguments(config, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR)
    assert _kernels(model) == STOCK
    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 4, "labels": [[1, 2, 3, 4]] * 4})
    collator = PackedCollator(pad_token_id=0)
    if loop == "accelerate":  # the manual loop's own preparation, up to accelerate's prepare
        loader = torch.utils.data.DataLoader(rows, batch_size=2, collate_fn=collator)
        model, *_ = manual_loop._prepare(Accelerator(cpu=True), args, None, model, loader, 1, ds_plugin=None,
                                         shard_ourselves=False)
    else:  # the Trainer's train(), stopped when training begins: liger is applied by then, nothing has run

        class Stop(TrainerCallback):
            def on_train_begin(self, *_, **__):
                raise _StopBeforeTheFirstStep

        trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collator, callbacks=[Stop()])
        with pytest.raises(_StopBeforeTheFirstStep):
            trainer.train()
        model = trainer.model
    assert _kernels(model) == expected
