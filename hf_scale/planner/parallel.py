"""TP, CP and HSDP x TP candidates of the planner: which sizes make sense for a model and topology, their memory
per GPU and their speed score.

Memory follows what accelerate builds (FSDP2 over the ``dp_shard x cp`` mesh dimension, TP inside it, transformers'
Llama ``tp_plan``): parameters, gradients and optimizer states are split over every rank that does not replicate
(dp_shard x cp x tp); activations over cp (each rank holds 1/cp of the tokens) and, for the TP-split projections,
over tp; the norms' inputs and the residual stream stay whole on each TP rank (no sequence parallelism in the tp_plan);
the logits over cp only (``lm_head`` is ``colwise_gather_output``: every TP rank gets all of them).
"""

from __future__ import annotations

from dataclasses import replace

from hf_scale.parallelism import Layout, cp_problem, head_problem
from hf_scale.planner.estimate import FP32, OPTIMIZER_STATE_BYTES, Candidate, Estimate, Workload, _ceil_div

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
    """FSDP2 x TP (TP inside a machine), FSDP2 x CP (sequence length a multiple of 2 x cp), each with and without
    CPU offload; HSDP x TP across machines. Only sizes the model's heads and the topology allow."""
    s, out = w.shapes, []
    for name in ("tp", "cp"):
        for size in SIZES:
            layout = Layout(**{name: size}, dp_shard=w.world_size // size)
            if w.world_size % size or layout.dp_shard * layout.cp < 2:
                continue
            if name == "tp" and (w.gpus_per_machine % size
                                 or head_problem(layout, s.num_attention_heads, s.num_key_value_heads)):
                continue  # TP across machines is refused; heads must split whole
            if name == "cp" and cp_problem(layout, attn_implementation="sdpa", seq_len=w.seq_len):
                continue
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


def activation_bytes(w: Workload, *, checkpointing: bool, tp: int, cp: int) -> int:
    """estimate.activation_bytes with the tokens split over cp and the TP-split tensors over tp."""
    s = w.shapes
    a, h, i = w.weight_bytes, s.hidden_size, s.intermediate_size
    kv = s.num_key_value_heads * s.head_dim
    tokens = _ceil_div(w.tokens, cp)
    # Norms (fp32 upcast + output) stay whole on each TP rank; q, k, v, attention output and the MLP are split.
    per_layer = 2 * (FP32 + a) * h + _ceil_div(a * (2 * h + 2 * kv) + 4 * a * i, tp)
    if checkpointing:
        return (s.num_layers * a * h + per_layer) * tokens
    return (s.num_layers * per_layer + (a + FP32) * h) * tokens


def fsdp_estimate(w: Workload, c: Candidate, logits: int) -> Estimate:
    """Memory of an FSDP2 candidate with TP/CP (and optionally FSDP2's CPU offload)."""
    s = w.shapes
    replicas = w.num_machines if c.hybrid else 1
    shards = w.world_size // replicas  # dp_shard x cp x tp: every rank of a replica holds a distinct piece
    trainable, frozen = w.trainable_params, w.frozen_params
    a, state = w.weight_bytes, OPTIMIZER_STATE_BYTES[w.optimizer]
    embed = s.vocab_size * s.hidden_size
    root = s.total_params - s.num_layers * s.decoder_layer_params
    # Gathered over dp_shard x cp: the root (embedding whole, lm_head split over tp) and two TP-split layers,
    # plus one layer's fp32 gradient before its reduce-scatter.
    layer = _ceil_div(s.decoder_layer_params, c.tp)
    gathered = a * (embed + _ceil_div(root - embed, c.tp) + 2 * layer) + FP32 * layer
    params = _ceil_div(FP32 * trainable + a * frozen, shards)
    grads = _ceil_div(FP32 * trainable, shards)
    optimizer = _ceil_div(state * trainable, shards)
    cpu = 0
    if c.offload_params:
        cpu = (params + grads + optimizer) * w.gpus_per_machine
        params = grads = optimizer = 0
    return Estimate(
        c,
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=activation_bytes(w, checkpointing=c.activation_checkpointing, tp=c.tp, cp=c.cp),
        logits=_ceil_div(logits, c.cp),
        buffers=gathered,
        cpu_per_machine=cpu,
        notes=(f"sharded over {shards} GPUs (tp={c.tp}, cp={c.cp})",),
    )
