"""TP, CP, EP and HSDP x TP candidates of the planner (the strategy catalogue's varied entries): which sizes make sense
for a model and topology (their memory: hf_scale.planner.estimate.fsdp_parallel_estimate; their time:
hf_scale.planner.time_model).

Memory follows what accelerate builds (FSDP2 over the ``dp_shard x cp`` mesh dimension, TP inside it, transformers'
Llama ``tp_plan``): parameters, gradients and optimizer states are split over every rank that does not replicate
(dp_shard x cp x tp); activations over cp (each rank holds 1/cp of the tokens) and, for the TP-split projections,
over tp; the norms' inputs and the residual stream stay whole on each TP rank (no sequence parallelism in the tp_plan);
the logits over cp only (``lm_head`` is ``colwise_gather_output``: every TP rank gets all of them).
"""

from __future__ import annotations

from dataclasses import replace

from hf_scale.config import expert_parallel
from hf_scale.config.parallelism import Layout, head_problem
from hf_scale.planner import strategies
from hf_scale.planner.estimate import Candidate, Workload

SIZES = (2, 4, 8)
"""TP and CP degrees offered: TP past 8 leaves an 8-GPU machine; CP past 8 is past what the ring overlaps."""


def candidates(w: Workload, base: list[Candidate]) -> list[Candidate]:
    """The catalogue's entries that vary tp or cp (FSDP2 x TP, HSDP x TP, FSDP2 x CP, with and without CPU offload) at
    each size the model's heads and the topology allow, then the EP ones (:func:`expert_candidates`); named by
    hf_scale.config.presets.sized_name. TP stays inside a machine; HSDP x TP needs a shard group of more than one TP
    group in each of several machines. A sequence length that is no multiple of 2 x cp is no reason to drop CP: train.py
    pads it (Workload.cp_seq_len), and the CP rows are estimated at the padded length."""
    s, out = w.shapes, []
    for name in ("tp", "cp"):
        for size in SIZES:
            layout = Layout(**{name: size}, dp_shard=w.world_size // size)
            if w.world_size % size or layout.dp_shard * layout.cp < 2:
                continue
            if name == "tp" and (w.gpus_per_machine % size
                                 or head_problem(layout, s.num_attention_heads, s.num_key_value_heads)):
                continue  # TP across machines is refused; heads must split whole
            for entry in strategies.planned(name):
                c = strategies.candidate(entry.name, size)
                if not c.hybrid or (w.num_machines > 1 and w.gpus_per_machine // size > 1):
                    out.append(c)
    out += expert_candidates(w)
    return [replace(c, activation_checkpointing=ac) for c in out for ac in {b.activation_checkpointing for b in base}]


def expert_candidates(w: Workload) -> list[Candidate]:
    """The catalogue's entries that vary ep (FSDP2 x EP, with and without CPU offload) for a full fine-tune of a
    mixture-of-experts model: every ep in SIZES that divides its experts and fits inside one machine
    (hf_scale.config.expert_parallel's rules, with dp_shard = the world). Not with LoRA/QLoRA: adapters on
    expert-parallel
    weights are not proven (train.py refuses them)."""
    s = w.shapes
    if not s.is_moe or w.lora_r or not s.ep_plan:
        return []  # without an EP plan transformers cannot split the experts (train.py refuses ep)
    out = []
    for ep in SIZES:
        layout = Layout(dp_shard=w.world_size, ep=ep)
        problems, _ = expert_parallel.layout_problems(layout, strategy="fsdp", fsdp_version=2,
                                                      processes_per_machine=w.gpus_per_machine)
        if problems or s.num_experts % ep:
            continue
        # the offload entry: FSDP2's CPU offload, transformers' DistributedConfig(fsdp_cpu_offload)
        out += [strategies.candidate(entry.name, ep) for entry in strategies.planned("ep")]
    return out
