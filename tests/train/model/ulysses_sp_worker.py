"""Worker for test_sequence_parallel.py (run under torchrun, gloo): DeepSpeed's Ulysses sequence parallelism on
the embedded tiny Llama, sp = the world size, against the same DeepSpeed run in one process.

With 2 processes: accelerate's recipe for sp_backend="deepspeed" (accelerator.py, _prepare_deepspeed):
``UlyssesSPAttentionHF.register_with_transformers`` (heads exchanged by all-to-all around SDPA),
``deepspeed.initialize(..., mpu=...)``, and ``UlyssesSPDataLoaderAdapter`` (each rank gets 1/sp of every
sequence, with its ``shift_labels``). Each rank's loss is its share of the sequence's mean: the sum of its token
losses over the sequence's target count (one all-reduce of the counts); DeepSpeed sums the gradients over the
sp group, which gives the whole sequence's gradient. (accelerate's test script instead all-gathers the losses
differentiably; the all-gather's backward sums over the ranks and doubles the gradient: measured 2x here.)

Writes {"losses": [...], "grad_norms": [...]} (rank 0) to the path given as the second argument.
"""

import json
import sys

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from hf_scale.config.parallelism import Layout
from hf_scale.train.model.sequence_parallel import loss_multiplier

ROWS, SEQ_LEN, PROMPTS = 4, 32, (3, 9, 17, 5)  # masked prompts: the shards hold unequal target counts


def main(model_dir: str, output: str, zero_stage: int = 0, clipping: float = 0.0) -> None:
    torch.manual_seed(7)
    deepspeed.init_distributed(dist_backend="gloo")
    sp, rank = dist.get_world_size(), dist.get_rank()
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    ids = torch.randint(3, model.config.vocab_size, (ROWS, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    for row, prompt in enumerate(PROMPTS):
        labels[row, :prompt] = -100
    # SGD, not Adam: Adam's update hardly depends on the gradient's scale, so it would hide a wrong one. So would
    # clipping (DeepSpeed's default gradient_clipping is 1.0): a clipped gradient has norm 1 whatever its scale.
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_optimization": {"stage": zero_stage},
              "zero_allow_untested_optimizer": True}
    if clipping:  # a bound above every norm: nothing clipped, and DeepSpeed reports its global gradient norm
        config["gradient_clipping"] = clipping
    rows = [{"input_ids": ids[i:i + 1], "labels": labels[i:i + 1], "position_ids": torch.arange(SEQ_LEN)[None]}
            for i in range(ROWS)]
    kwargs, group = {}, None
    if sp > 1:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp,
            micro_batch_size=1, seq_length=SEQ_LEN, seq_length_is_variable=True)
        kwargs["mpu"], group = mpu, mpu.get_sequence_parallel_group()
        # The adapter takes one batch from each rank and yields them in turn, rank 0's first: rank r reads rows
        # r, r + sp, ... so the steps see rows 0, 1, 2, 3 as the one process does.
        rows = UlyssesSPDataLoaderAdapter(rows[rank::sp], sp_rank=rank, sp_group=group, sp_world_size=sp,
                                          device=torch.device("cpu"))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, **kwargs)
    result = {"losses": [], "grad_norms": []}
    for batch in rows:
        if sp > 1:
            shift_labels = batch.pop("shift_labels")
            logits = engine(**batch).logits
            targets = (shift_labels != -100).sum()
            dist.all_reduce(targets, group=group)
            multiplier = loss_multiplier(Layout(sp=sp), zero_stage)  # hf_scale's rule (sequence_parallel.py)
            loss = model.loss_function(logits=logits, labels=None, shift_labels=shift_labels,
                                       vocab_size=model.config.vocab_size, num_items_in_batch=targets) * multiplier
            shown = loss.detach().clone() / multiplier
            dist.all_reduce(shown, group=group)
        else:
            loss = engine(**batch).loss
            shown = loss.detach()
        engine.backward(loss)
        if zero_stage < 3:  # ZeRO-3 partitions the gradients: the losses (SGD) tell their scale
            result["grad_norms"].append(torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])).item())
        engine.step()
        if clipping and engine.get_global_grad_norm() is not None:
            result.setdefault("engine_grad_norms", []).append(float(engine.get_global_grad_norm()))
        result["losses"].append(shown.item())
    if rank == 0:
        with open(output, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()  # else gloo aborts at exit (shared/notes/cpu-distributed.md)


if __name__ == "__main__":
    stage, clip = (sys.argv[3:] + ["0", "0"])[:2]  # optional: ZeRO stage, gradient_clipping
    main(sys.argv[1], sys.argv[2], int(stage), float(clip))
