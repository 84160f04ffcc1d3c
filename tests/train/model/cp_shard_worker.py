"""Worker for test_context_parallel.py (torchrun, gloo): train.py's context parallelism on CPU up to the ring kernel,
with accelerate's and torch's own code. cp=2 on 2 processes, or dp_shard=2 x cp=2 on 4.

accelerate refuses a ParallelismConfig on MULTI_CPU when it builds the Accelerator (``_validate_accelerator``), and
torch's ring attention has no CPU kernel. Everything else runs as on GPUs: the Accelerator's state gets the
ParallelismConfig train.py builds (context_parallel.accelerate_config) and its device mesh, as the Accelerator's
constructor sets them; ``Accelerator._prepare_cp`` (what ``prepare`` calls) attaches the attention hooks and binds
torch's ``context_parallel`` to the cp mesh; accelerate's data loader splits the batches by data-parallel rank from
that mesh; ``context_parallel.sharded`` (accelerator.maybe_context_parallel) shards each collated batch in place.

Then the loss rule of the manual loop and the Trainer: the model runs the whole sequence (what ring attention
computes, without it) and each rank takes its chunks' token losses from the sharded position_ids; each rank's loss
is their sum over the window's targets (counted before sharding, summed over all ranks, divided by
Layout.loader_copies) times context_parallel.loss_multiplier, and the gradients are averaged over all ranks (what
FSDP2's reduce-scatter over dp_shard x cp does). That must equal one process's gradient of the global batch.

Writes a JSON of what it saw (rank 0) to the path given as the second argument.
"""

import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator, PartialState
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_scale.config.parallelism import Layout
from hf_scale.train.data.batches import count_target_tokens, make_collator
from hf_scale.train.data.packing import model_inputs
from hf_scale.train.model import context_parallel

LENGTHS = (13, 7, 21, 9, 16, 11, 5, 18)  # unequal rows: padding to a multiple of 2 x cp, prompts masked
ROWS_PER_BATCH = 2


def rows(vocab: int) -> list[dict]:
    generator = torch.Generator().manual_seed(3)
    out = []
    for length in LENGTHS:
        ids = torch.randint(4, vocab, (length,), generator=generator).tolist()
        labels = [-100] * (length // 3) + ids[length // 3:]
        out.append({"input_ids": ids, "attention_mask": [1] * length, "labels": labels})
    return out


def main(model_dir: str, output: str) -> None:
    PartialState(cpu=True, backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = Layout(dp_shard=world // 2, cp=2)
    accelerator = Accelerator(cpu=True)
    config = context_parallel.accelerate_config(layout, "allgather")
    accelerator.state.parallelism_config = config
    accelerator.state.device_mesh = config.get_device_mesh("cpu")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
    accelerator._prepare_cp(model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    collate = context_parallel.collator(make_collator(tokenizer, packing=False), layout, tokenizer)
    loader = accelerator.prepare_data_loader(DataLoader(rows(model.config.vocab_size), batch_size=ROWS_PER_BATCH,
                                                        collate_fn=collate))
    window = list(loader)  # one accumulation window: this rank's micro-batches
    wholes = [{key: value.clone() for key, value in batch.items()} for batch in window]
    seen: list = [None] * world
    dist.all_gather_object(seen, [whole["input_ids"].tolist() for whole in wholes])

    local_targets = torch.tensor(sum(count_target_tokens(batch) for batch in window))
    global_targets = accelerator.reduce(local_targets.clone(), reduction="sum") // layout.loader_copies
    shards, losses = [], []
    vocab = model.config.vocab_size
    model.zero_grad()
    for batch, whole in zip(window, wholes, strict=True):
        with context_parallel.sharded(accelerator, batch, layout):
            pass  # the buffers are sharded on entry and stay so (no_restore_buffers); the model runs outside
        positions = batch["position_ids"]
        shards.append({"length": whole["input_ids"].shape[1], "positions": positions[0].tolist(),
                       "same_rows": all(torch.equal(batch[key], whole[key].gather(1, positions))
                                        for key in context_parallel.BUFFER_KEYS)})
        logits = model(input_ids=whole["input_ids"], position_ids=whole["position_ids"]).logits
        chunk_logits = logits.gather(1, positions[..., None].expand(-1, -1, vocab))
        loss = model.loss_function(logits=chunk_logits, labels=None, shift_labels=batch["shift_labels"],
                                   vocab_size=vocab, num_items_in_batch=global_targets)
        (loss * context_parallel.loss_multiplier(layout, layout.data_parallel_size)).backward()
        losses.append(loss.detach())
    for parameter in model.parameters():  # FSDP2's reduce-scatter over dp_shard x cp averages
        dist.all_reduce(parameter.grad)
        parameter.grad /= world
    cp_grads = [parameter.grad.clone() for parameter in model.parameters()]
    # The ring kernel itself, on a fresh copy of a batch: on CPU torch stops here (what train.py's refusal names).
    try:
        batch = {key: value.clone() for key, value in wholes[0].items()}
        with context_parallel.sharded(accelerator, batch, layout):
            model(**model_inputs(batch), num_items_in_batch=global_targets)
        ring_error = None
    except Exception as error:  # noqa: BLE001 - the failure is the result on CPU
        ring_error = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    step_loss = accelerator.reduce(torch.stack(losses).sum(), reduction="sum") / layout.whole_batch_copies

    # One process: every data-parallel rank's whole batches, one token-loss sum over the global target count.
    model.zero_grad()
    data_ranks = {tuple(map(tuple, batch)) for per_rank in seen for batch in per_rank}
    everything: list = [None] * world
    dist.all_gather_object(everything, [{key: value.tolist() for key, value in whole.items()} for whole in wholes])
    unique = {json.dumps(batch["input_ids"]): batch for per_rank in everything for batch in per_rank}
    total = sum(model(input_ids=torch.tensor(b["input_ids"]), position_ids=torch.tensor(b["position_ids"]),
                      labels=torch.tensor(b["labels"]), num_items_in_batch=global_targets).loss
                for b in unique.values())
    total.backward()
    errors = [float((cp - one.grad).abs().max() / one.grad.abs().max())
              for cp, one in zip(cp_grads, model.parameters(), strict=True)]
    if rank == 0:
        with open(output, "w") as f:
            json.dump({"world": world, "layout": layout.describe(), "batches_per_rank": [len(r) for r in seen],
                       "same_batches_in_a_cp_group": [seen[r] == seen[r + 1] for r in range(0, world, 2)],
                       "data_parallel_batches": len(data_ranks), "shards": shards,
                       "global_targets": int(global_targets), "one_process_targets":
                           sum(count_target_tokens({"labels": torch.tensor(b["labels"])}) for b in unique.values()),
                       "step_loss": float(step_loss), "one_process_loss": float(total),
                       "max_relative_grad_error": max(errors), "ring_attention_error": ring_error}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
