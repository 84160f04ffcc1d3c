"""TP, CP and HSDP x TP candidates of the planner: which sizes make sense for a model and topology, and their speed
score (their memory: hf_scale.planner.estimate.fsdp_parallel_estimate).

Memory follows what accelerate builds (FSDP2 over the ``dp_shard x cp`` mesh dimension, TP inside it, transformers'
Llama ``tp_plan``): parameters, gradients and optimizer states are split over every rank that does not replicate
(dp_shard x cp x tp); activations over cp (each rank holds 1/cp of the tokens) and, for the TP-split projections,
over tp; the norms' inputs and the residual stream stay whole on each TP rank (no sequence parallelism in the tp_plan);
the logits over cp only (``lm_head`` is ``colwise_gather_output``: every TP rank gets all of them).
"""

from __future__ import annotations

from dataclasses import replace

from hf_scale.parallelism import Layout, head_problem
from hf_scale.planner.estimate import Candidate, Workload

SIZES = (2, 4, 8)
"""TP and CP degrees offered: TP past 8 leaves an 8-GPU machine; CP past 8 is past what the ring overlaps."""
# Per TP degree: TP all-reduces every layer's activations twice forward and twice backward over NVLink; the
# fraction of the step it costs grows with the degree (each rank's matmuls shrink, the all-reduce does not).
TP_SPEED = {2: 0.85, 4: 0.75, 8: 0.65}
# Per CP degree: the ring passes K/V chunks while attention computes; at long sequences it mostly overlaps.
CP_SPEED = {2: 0.92, 4: 0.88, 8: 0.84}
OFFLOAD_SPEED = 0.30 / 0.86
"""FSDP2 CPU offload (parameters and gradients in CPU RAM, the optimizer step on the CPU) relative to sharding on
the GPU: the ZeRO-3 full-offload over ZeRO-3 ratio of the base table."""


def candidates(w: Workload, base: list[Candidate]) -> list[Candidate]:
    """FSDP2 x TP (TP inside a machine), FSDP2 x CP, each with and without CPU offload; HSDP x TP across machines.
    Only sizes the model's heads and the topology allow. A sequence length that is no multiple of 2 x cp is no
    reason to drop CP: train.py pads it (Workload.cp_seq_len), and the CP rows are estimated at the padded length."""
    s, out = w.shapes, []
    for name in ("tp", "cp"):
        for size in SIZES:
            layout = Layout(**{name: size}, dp_shard=w.world_size // size)
            if w.world_size % size or layout.dp_shard * layout.cp < 2:
                continue
            if name == "tp" and (w.gpus_per_machine % size
                                 or head_problem(layout, s.num_attention_heads, s.num_key_value_heads)):
                continue  # TP across machines is refused; heads must split whole
            label = f"FSDP2 x {name.upper()}={size}"
            for offload in (False, True):
                key = f"fsdp2_{name}{size}" + ("_offload" if offload else "")
                out.append(Candidate(key, label + (" + offload" if offload else ""), "fsdp",
                                     offload_params=offload, **{name: size}))
            if name == "tp" and w.num_machines > 1 and w.gpus_per_machine // size > 1:
                out.append(Candidate(f"fsdp2_hybrid_tp{size}", f"HSDP x TP={size}", "fsdp", hybrid=True, tp=size))
    return [replace(c, activation_checkpointing=ac) for c in out for ac in {b.activation_checkpointing for b in base}]


def speed(w: Workload, c: Candidate, base: float) -> float:
    """``base``: the score of the same sharding without TP/CP."""
    score = base * TP_SPEED.get(c.tp, 1.0) * CP_SPEED.get(c.cp, 1.0)
    return score * OFFLOAD_SPEED if c.offload_params else score
