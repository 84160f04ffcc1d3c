"""Context parallelism (cp=2) against one process, for the GPU issue: torch's ``context_parallel`` over SDPA, the
mechanism accelerate's ``ParallelismConfig(cp_size=...)`` applies (accelerator.maybe_context_parallel).

    torchrun --nproc_per_node 2 benchmarks/gpu_cp.py [--output cp.json]

Each rank loads the embedded tiny Llama (fp32, SDPA), takes the same batch (2 rows of 256 tokens), and runs
forward + backward with its sequences sharded over the cp mesh (load-balanced: 2 x cp chunks); rank 0 then runs
the same batch unsharded and reports both losses (equal to rtol 1e-4 is the proof). On a single-GPU machine
both ranks share cuda:0 (the issue's "two ranks on one device"). Not a pytest test: on CPU, torch 2.13 stops
with "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered",
which is why train.py refuses cp on machines without GPUs (hf_scale/parallelism.py: train_refusal).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
SEQ, ROWS = 256, 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=None, help="a JSON file for the result")
    args = parser.parse_args()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda and torch.cuda.device_count() >= dist.get_world_size() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(REPO / "hf_scale" / "assets" / "tiny-llama", dtype=torch.float32,
                                                 attn_implementation="sdpa").to(device)
    ids = torch.randint(3, model.config.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(1)).to(device)
    labels = ids.clone()
    positions = torch.arange(SEQ, device=device).expand(ROWS, SEQ).contiguous()
    result: dict = {"world": world, "device": str(device), "torch": torch.__version__}
    try:
        # Labels are shifted before sharding (each shard's last token needs the next shard's first).
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
        with context_parallel(mesh, buffers=[ids, shifted, positions], buffer_seq_dims=[1, 1, 1]):
            logits = model(input_ids=ids, position_ids=positions).logits
            loss_sum = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shifted.flatten(), reduction="sum")
        total = loss_sum.detach().clone()
        dist.all_reduce(total)
        loss_sum.backward()
        result["cp_loss"] = total.item() / (ROWS * (SEQ - 1))
    except Exception as error:  # noqa: BLE001 - the failure is the result on CPU
        result["cp_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    if rank == 0:
        reference = AutoModelForCausalLM.from_pretrained(REPO / "hf_scale" / "assets" / "tiny-llama",
                                                         dtype=torch.float32, attn_implementation="sdpa").to(device)
        result["one_process_loss"] = reference(input_ids=ids, labels=labels).loss.item()
        print(json.dumps(result))
        if args.output:
            args.output.write_text(json.dumps(result, indent=2) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if "cp_loss" in result or rank != 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
