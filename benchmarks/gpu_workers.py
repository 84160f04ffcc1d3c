"""The references gpu.py measures hf_scale's train.py against, each run by gpu.py as its own process:

    python benchmarks/gpu_workers.py baseline|torch --worker-out RESULT.json --model DIR --data FILE ...

* ``baseline``: ``transformers.Trainer`` with default TrainingArguments except bf16, batch and steps; pad-to-longest
  collator, --micro-batch examples per step.
* ``torch``: plain PyTorch, no hf_scale: one row of --budget tokens per step, examples packed greedily in a
  shuffled order, sdpa with the dense document mask transformers builds from restarting position ids, fp32 master
  weights + bf16 autocast (--bf16-params: bf16 parameters), fused AdamW.

Each writes its step times, real tokens per step, losses and peak memory to --worker-out (JSON); gpu.py turns them
into the same row as a train.py variant's metrics.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path


def _tokenized(ns: argparse.Namespace):
    from transformers import AutoTokenizer

    from hf_scale.contract.data_arguments import DataArguments
    from hf_scale.train.data.pipeline import load_raw_datasets, tokenize_dataset

    tokenizer = AutoTokenizer.from_pretrained(ns.model)
    data_args = DataArguments(train_file=ns.data, max_seq_length=ns.seq_len)
    return tokenizer, tokenize_dataset(load_raw_datasets(data_args)["train"], tokenizer, data_args)


def _clock(cuda: bool):
    import time

    import torch

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()  # a step's time is its GPU work, not the kernel launches
        return time.perf_counter()

    return now


def _baseline_worker(ns: argparse.Namespace) -> dict:
    """The plain HF Trainer in this process: step times, real tokens per step, losses."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    set_seed(0)
    tokenizer, dataset = _tokenized(ns)
    pad = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, padding="longest", return_tensors="pt")
    batch_tokens: list[int] = []

    def collate(features):
        batch = pad(features)
        batch_tokens.append(int(batch["attention_mask"].sum()))  # real tokens; GA 1: batch k is step k
        return batch

    now = _clock(torch.cuda.is_available())

    class StepClock(TrainerCallback):
        times: list[float] = []
        losses: list[float] = []
        last = 0.0

        def on_train_begin(self, *_, **__):
            self.last = now()

        def on_step_end(self, *_, **__):
            self.times.append(now() - self.last)
            self.last = now()

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

    args = TrainingArguments(
        output_dir=ns.output_dir,
        per_device_train_batch_size=ns.micro_batch,
        max_steps=ns.steps,
        bf16=ns.bf16,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
    )
    clock = StepClock()
    model = AutoModelForCausalLM.from_pretrained(ns.model)
    Trainer(model=model, args=args, train_dataset=dataset, data_collator=collate, callbacks=[clock]).train()
    return {"step_times": clock.times, "tokens": batch_tokens[: len(clock.times)], "losses": clock.losses}


def _greedy_rows(lengths: list[int], budget: int, seed: int = 0) -> list[list[int]]:
    """Example indices in a shuffled order, cut into rows of at most `budget` tokens (first fit in order)."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    rows, row, used = [], [], 0
    for index in order:
        if used + lengths[index] > budget and row:
            rows.append(row)
            row, used = [], 0
        row.append(index)
        used += lengths[index]
    return rows + ([row] if row else [])


def _torch_packed_batch(dataset, members: list[int], budget: int, pad_id: int, device):
    import torch

    ids, labels, positions = [], [], []
    for index in members:
        example = dataset[index]
        ids += example["input_ids"]
        labels += [-100] + example["labels"][1:]  # no example predicts the next one's first token
        positions += range(len(example["input_ids"]))
    real, padding = len(ids), budget - len(ids)
    ids, labels, positions = ids + [pad_id] * padding, labels + [-100] * padding, positions + list(range(padding))
    batch = {k: torch.tensor([v], device=device) for k, v in (("input_ids", ids), ("labels", labels),
                                                                   ("position_ids", positions))}
    return batch, real


def _torch_packed_worker(ns: argparse.Namespace) -> dict:
    """Plain PyTorch: one packed row of --budget tokens per step, sdpa + dense document mask, fused AdamW."""
    import torch
    from transformers import AutoModelForCausalLM, set_seed

    from hf_scale.train.loops.torch_profiler import StepProfiler

    set_seed(0)
    tokenizer, dataset = _tokenized(ns)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if ns.bf16_params else torch.float32
    model = AutoModelForCausalLM.from_pretrained(ns.model, attn_implementation="sdpa", dtype=dtype).to(device)
    model.config.use_cache = False  # else transformers ignores the packed position ids
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    rows = _greedy_rows([len(ids) for ids in dataset["input_ids"]], ns.budget)
    profiler = StepProfiler(Path(ns.profile_dir), wait=ns.warmup, active=3) if ns.profile_dir else None
    now, times, tokens, losses = _clock(cuda), [], [], []
    last = now()
    for step in range(ns.steps):
        batch, real = _torch_packed_batch(dataset, rows[step % len(rows)], ns.budget, tokenizer.pad_token_id, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=ns.bf16):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(now() - last)
        last = now()
        tokens.append(real)
        if profiler:
            profiler.step()
    if profiler:
        profiler.finish()
    return {"step_times": times, "tokens": tokens, "losses": losses}


def run(ns: argparse.Namespace) -> int:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    result = _baseline_worker(ns) if ns.worker == "baseline" else _torch_packed_worker(ns)
    result["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None
    Path(ns.worker_out).write_text(json.dumps(result))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("worker", choices=("baseline", "torch"))
    parser.add_argument("--worker-out", required=True, help="where the results go (JSON)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--output-dir", required=True, help="the Trainer's output_dir (baseline)")
    parser.add_argument("--profile-dir", help="torch.profiler's output (torch)")
    for name in ("--seq-len", "--budget", "--micro-batch", "--steps", "--warmup"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast / TrainingArguments(bf16=True)")
    parser.add_argument("--bf16-params", action="store_true", help="torch: bf16 parameters")
    return parser


if __name__ == "__main__":
    sys.exit(run(_parser().parse_args()))
