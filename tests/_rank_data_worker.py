"""Run by tests/train/data/test_data.py under ``torchrun --nproc_per_node 2``: records the samples each rank sees.

Every rank builds the real data pipeline (load, tokenize, collate, shuffle) and the real
``accelerator.prepare``, iterates two epochs and writes ``OUT/rank<N>.json`` with, per epoch, the
sample ids of each micro-batch in the order it saw them. Sample ``i`` is the text line
``sample i``, so the id is read back from the decoded tokens.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs
from transformers import AutoTokenizer

from hf_scale.contract.data_arguments import DataArguments
from hf_scale.contract.embedded_assets import EMBEDDED_MODEL_DIR
from hf_scale.train.data.batches import make_collator, make_train_dataloader
from hf_scale.train.data.pipeline import load_raw_datasets, tokenize_dataset


def sample_ids(batch, tokenizer) -> list[int]:
    ids = []
    for row, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True):
        text = tokenizer.decode(row[mask.bool()], skip_special_tokens=True)
        ids.append(int(text.removeprefix("sample ")))
    return ids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--micro_batch_size", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    # gloo: without it accelerate on a CPU-only machine silently runs each process alone.
    accelerator = Accelerator(
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
    )
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    data_args = DataArguments(train_file=args.train_file)
    with accelerator.main_process_first():
        train = tokenize_dataset(load_raw_datasets(data_args)["train"], tokenizer, data_args)
    dataloader = make_train_dataloader(
        train, make_collator(tokenizer, packing=False), args.micro_batch_size, args.seed
    )
    dataloader = accelerator.prepare(dataloader)

    epochs = {}
    for epoch in range(args.epochs):
        dataloader.set_epoch(epoch)
        epochs[epoch] = [sample_ids(batch, tokenizer) for batch in dataloader]

    record = {
        "process_index": accelerator.process_index,
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "epochs": epochs,
    }
    out = Path(args.out) / f"rank{accelerator.process_index}.json"
    out.write_text(json.dumps(record))
    accelerator.wait_for_everyone()
    # Without this a gloo run aborts at interpreter exit (see shared notes on CPU distributed runs).
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
