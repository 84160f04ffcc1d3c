"""Predicted time of one training step of a candidate on a GPU profile: compute, communication, optimizer step,
CPU offload, and the checkpoint save (docs/plan.md, "Time" explains the model and its measured accuracy).

Compute per micro-batch on one GPU:
* GEMMs: 2 FLOPs per weight per token forward, twice that backward (gradients of activations and of weights;
  a frozen LoRA/QLoRA base has no weight gradients: 2 + 2), the weights being the decoder layers' linears split over
  TP and ``lm_head``; achieved at the fraction :func:`gemm_efficiency` of the dense peak, which grows with the GEMM's
  size (small GEMMs cannot fill the GPU).
* Attention (flash/sdpa kernels, causal: half the score matrix): 2 x seq x heads x head_dim FLOPs per token forward,
  2.5 x that backward (flash recomputes the scores), at the GPU's attention efficiency.
* Everything else (norms, residual adds, RoPE, SwiGLU's activation, the loss over the vocabulary, QLoRA's
  dequantisation) is bound by memory bandwidth: its bytes / HBM bandwidth.
* Activation checkpointing recomputes the forward in backward.
Communication per layout: its bytes per GPU over the slowest link its group spans (NVLink/PCIe inside a machine,
the network across machines) at :data:`LINK_EFFICIENCY`; the engine hides :data:`OVERLAP` of it behind compute.

A mixture-of-experts model computes, per token, only its active weights (the dense part and top-k routed experts:
ModelShapes.mlp_width), so FLOPs, tokens/s and MFU count active parameters; each expert's GEMM sees only the tokens
routed to it (t x k / experts on one rank, ep times that under expert parallelism), which the GEMM efficiency
charges. FSDP gathers every expert's weights each micro-batch; expert parallelism gathers 1/ep of them, over the
ep x dp_shard x tp / ep ranks holding the same experts, and adds per MoE layer two all-to-alls forward and two
backward (:func:`all_to_all_s`), not overlapped (transformers' dispatch waits for them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hf_scale.planner.estimate import Candidate, Workload
from hf_scale.planner.hardware import Hardware

Recompute = Literal["none", "full", "selective_layer", "selective_op"]

GEMM_HALF_FLOPS = 1e10
"""The GEMM size (FLOPs of one forward matmul) at which the efficiency is half its maximum."""
LINK_EFFICIENCY = 0.80
"""Bus bandwidth NCCL reaches of a link's rate (nccl-tests on NVLink and InfiniBand: 75-90%)."""
KERNEL_OVERHEAD_S = 150e-6
"""Launch gaps and Python per decoder layer per micro-batch, forward + backward (eager mode)."""
ELEMENTWISE_BYTES = (16, 4)
"""Bytes moved forward per token per layer, per element of (hidden, intermediate) at 16-bit: two RMSNorms (read +
write 2 x hidden), two residual adds (3 x hidden each), RoPE and layout copies (~3 x hidden); SwiGLU reads gate and
up, writes its activation and the product (4 x intermediate). Backward moves twice as much."""
COMPILED_ELEMENTWISE_BYTES = (11, 3)
"""The same under torch.compile, whose Inductor fuses each residual add with the RMSNorm after it (read the input and
the residual, write the sum and the normalised output: 4 x hidden, twice per layer) and SwiGLU into one kernel (read
gate and up, write the product: 3 x intermediate); RoPE and layout copies (~3 x hidden) stay. Counted, not fitted."""
LOSS_BYTES_PER_LOGIT = 32
"""Bytes per logit of the loss, forward + backward: the 16-bit logits, their fp32 upcast, the log-softmax and the
gradient (hf_scale.planner.estimate.logits_bytes counts the same tensors)."""
OPTIMIZER_BYTES = 30
"""Bytes AdamW's step moves per trainable parameter: fp32 weight, gradient and two moments read, weight and moments
written, the 16-bit copy written."""
OVERLAP = {"ddp": 0.8, "deepspeed": 0.6, "fsdp": 0.85}
"""Share of the communication during forward/backward each engine hides behind compute (DDP buckets the gradient
all-reduce into backward; FSDP2 prefetches the next layer's all-gather; ZeRO's overlap_comm is less complete).
They decide FSDP2 vs ZeRO-2/3 where compute is equal. Bounded by published runs, not fitted (docs/plan.md, "Why FSDP2
ranks above ZeRO-2/ZeRO-3"): ms-swift's Qwen2.5-14B on 8 A800 (kept out of the accuracy) runs ZeRO-2 2.3% faster than
ZeRO-3 on the same data, an order the model keeps while DeepSpeed's share is at most 0.75 (at 0.6: 0.8% faster);
FlagPerf's ZeRO-3 Llama 2 7B on 8 A800 without checkpointing is predicted +8.6% at 0.6. Both lean towards ~0.3, too
few rows to move it. DDP's share no published row checks."""
COLLECTIVE_LATENCY_S = 30e-6
"""Fixed cost of one NCCL collective (launch and synchronisation), whatever its size: what makes per-layer gathers
dearer than a few bucketed all-reduces for small models."""
DDP_BUCKET_BYTES = 25 * 2**20
"""DDP's gradient bucket (bucket_cap_mb=25): one all-reduce per bucket."""
CP_OVERLAP = 0.9
"""Ring attention passes the next K/V chunk while the current one is computed."""
ALL_TO_ALLS_PER_MOE_LAYER = 4
"""Dispatch and combine forward, their gradients backward (transformers' all_to_all EP implementation)."""


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on each GPU, by term; its throughput and MFU."""

    compute_s: float
    communication_s: float
    """Communication not hidden behind compute."""
    communication_total_s: float
    """All of the step's communication, hidden or not (what decides whether the step is bound by it)."""
    optimizer_s: float
    offload_s: float
    """PCIe traffic of offloaded parameters/gradients and the CPU optimizer step."""
    tokens_per_gpu: float
    """Tokens one GPU's step trains (a TP/CP group shares its sequences)."""
    model_flops_per_gpu: float
    """FLOPs the step needs without recomputation (the MFU numerator)."""
    peak_flops: float
    save_s: float
    """Seconds to write a checkpoint (weights and optimizer states)."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.communication_s + self.optimizer_s + self.offload_s

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second per GPU."""
        return self.tokens_per_gpu / self.step_s

    @property
    def mfu(self) -> float:
        return self.model_flops_per_gpu / (self.step_s * self.peak_flops)

    @property
    def dominant(self) -> str:
        """The largest term: compute, communication, optimizer or offload."""
        terms = {
            "compute": self.compute_s,
            "communication": self.communication_total_s,
            "optimizer": self.optimizer_s,
            "offload": self.offload_s,
        }
        return max(terms, key=terms.__getitem__)


def gemm_efficiency(hw: Hardware, flops: float) -> float:
    """Achieved fraction of the peak of one GEMM of ``flops`` FLOPs: the GPU's large-GEMM efficiency, less for
    GEMMs too small to fill it."""
    return hw.gemm_efficiency * flops / (flops + GEMM_HALF_FLOPS)


def gemm_peak(w: Workload, hw: Hardware, fp8: bool) -> float:
    """Peak of the decoder layers' linears: the FP8 tensor cores under float8 training (torchao's float8 linears;
    lm_head stays in bf16), the precision's peak otherwise."""
    return hw.fp8_flops if fp8 and hw.fp8_flops else peak_flops(w, hw)


def peak_flops(w: Workload, hw: Hardware) -> float:
    """Dense peak of the precision: bf16/fp16 tensor cores, fp32 training at half of it (TF32)."""
    return hw.bf16_flops / 2 if w.precision == "no" else hw.bf16_flops


def _ring_s(nbytes: float, ranks: int, bandwidth: float) -> float:
    """A ring all-gather or reduce-scatter of a ``nbytes`` tensor over ``ranks`` ranks."""
    return 0.0 if ranks < 2 else nbytes * (ranks - 1) / ranks / (bandwidth * LINK_EFFICIENCY)


def _link(w: Workload, hw: Hardware, group: int) -> float:
    """The ring bandwidth of a group of ``group`` consecutive ranks. Across machines NCCL runs one ring per network
    adapter (rail): each ring crosses the network once per machine and carries 1/gpus_per_machine of the data, so
    the machine's adapters together, not one GPU's, bound it (and NVLink above that)."""
    if group <= w.gpus_per_machine:
        return hw.intra_node_bps
    return min(hw.intra_node_bps, w.gpus_per_machine * hw.inter_node_bps)


def _compute_s(
    w: Workload, c: Candidate, hw: Hardware, recompute: Recompute, tokens: int, compiled: bool, fp8: bool
) -> tuple[float, float]:
    """(seconds, model FLOPs) of forward + backward of one micro-batch of ``tokens`` tokens on one GPU."""
    s, peak = w.shapes, peak_flops(w, hw)
    elementwise = COMPILED_ELEMENTWISE_BYTES if compiled else ELEMENTWISE_BYTES
    attn_width = s.num_attention_heads * s.head_dim
    kv_width = s.num_key_value_heads * s.head_dim
    router = s.hidden_size * (s.num_experts or 0) * s.moe_layers / s.num_layers
    per_layer = s.hidden_size * (2 * attn_width + 2 * kv_width) + 3 * s.hidden_size * s.mlp_width + router
    bwd = 1.0 if w.lora_r else 2.0  # a frozen base has no weight gradients
    layer_flops = 2 * per_layer / c.tp * tokens
    head_flops = 2 * s.hidden_size * s.vocab_size / c.tp * tokens  # lm_head is split column-wise over TP
    mlp_gemm = 2 * tokens * s.hidden_size * s.intermediate_size / c.tp
    if s.is_moe:  # one expert's GEMM: the tokens routed to it (from the whole EP group) times its weights
        mlp_gemm = 2 * tokens * c.ep * s.experts_per_token / s.num_experts * s.hidden_size * s.expert_width
    gemm_rate = gemm_peak(w, hw, fp8) * gemm_efficiency(hw, mlp_gemm)
    head_rate = peak * gemm_efficiency(hw, head_flops)
    seq = w.cp_seq_len(c.cp)
    attn_fwd = 2 * seq * attn_width / c.tp * tokens * s.num_layers
    # per token per layer forward; CP ranks hold 1/cp of the tokens but attend to the whole sequence
    elem_fwd = (
        sum(k * n for k, n in zip(elementwise, (s.hidden_size, s.mlp_width / c.tp), strict=True))
        * w.weight_bytes
        / 2
        * tokens
        * s.num_layers
    )
    if w.load_in_4bit:  # bitsandbytes dequantises each 4-bit weight to 16 bits at every use
        elem_fwd += s.linear_params * (0.5 + 2)
    layers_fwd = (
        s.num_layers * layer_flops / gemm_rate + attn_fwd / (peak * hw.attention_efficiency) + elem_fwd / hw.hbm_bps
    )
    gemm_fwd = s.num_layers * layer_flops / gemm_rate
    fraction = {"none": 0.0, "full": 1.0, "selective_layer": 0.5}
    if recompute == "selective_op":  # every other matmul and the elementwise ops; attention is saved
        recompute_s = gemm_fwd / 2 + elem_fwd / hw.hbm_bps
    else:
        recompute_s = fraction[recompute] * layers_fwd
    seconds = (
        gemm_fwd * (1 + bwd)
        + attn_fwd * 3.5 / (peak * hw.attention_efficiency)
        + elem_fwd * 3 / hw.hbm_bps
        + head_flops * (1 + bwd) / head_rate
        + tokens * s.vocab_size * LOSS_BYTES_PER_LOGIT / hw.hbm_bps
        + recompute_s
        + s.num_layers * KERNEL_OVERHEAD_S
    )
    model_flops = (1 + bwd) * (s.num_layers * layer_flops + head_flops) + 3 * attn_fwd
    return seconds, model_flops


def _communication_s(
    w: Workload, c: Candidate, hw: Hardware, tokens: int, micro_steps: int, fp8_all_gather: bool = False
) -> tuple[float, float]:
    """(seconds hidden behind compute if the compute is long enough, seconds never hidden) per optimizer step.
    ``fp8_all_gather``: FSDP2 gathers the linears' weights as float8 (1 byte; torchao's
    enable_fsdp_float8_all_gather)."""
    s, n, b = w.shapes, w.world_size, w.weight_bytes
    trainable, total = w.trainable_params, s.total_params
    grads = b * trainable  # gradients are reduced in the compute dtype
    overlap = OVERLAP[c.engine]
    hidden = exposed = 0.0
    if c.engine == "ddp":
        # one bucketed all-reduce per step (no_sync while accumulating); fp32 gradients: DDP's weights are fp32
        ar = 2 * _ring_s(4 * trainable, n, _link(w, hw, n))
        ar += (n > 1) * -(-4 * trainable // DDP_BUCKET_BYTES) * COLLECTIVE_LATENCY_S
        return overlap * ar, (1 - overlap) * ar
    if c.engine == "deepspeed" and c.zero_stage in (1, 2):
        rs = (_ring_s(grads, n, _link(w, hw, n)) + (n > 1) * COLLECTIVE_LATENCY_S) * (
            micro_steps if c.zero_stage == 2 else 1
        )
        # the updated weights, after the step: nothing to hide
        ag = _ring_s(b * trainable, n, _link(w, hw, n)) + (n > 1) * COLLECTIVE_LATENCY_S
        return overlap * rs, (1 - overlap) * rs + ag
    # ZeRO-3 and FSDP2: every micro-batch gathers the weights forward and again backward, reduce-scatters gradients
    # FSDP2 shards over dp_shard x cp (every rank that is not a TP peer), hybrid inside one machine
    shard = (w.gpus_per_machine if c.hybrid else n) // c.tp
    link = _link(w, hw, shard * c.tp)
    params = (w.frozen_bytes if w.lora_r else b * total) / c.tp
    if fp8_all_gather:
        params -= (b - 1) * s.linear_params / c.tp
    per_micro = 2 * _ring_s(params, shard, link) + _ring_s(grads / c.tp, shard, link)
    if c.ep > 1:  # the dense part as above; the experts, 1/ep of them, over the ranks holding the same ones
        experts = b * s.expert_params
        efsdp = shard * c.tp // c.ep
        dense = 3 * _ring_s((b * total - experts) / c.tp, shard, link)
        per_micro = dense + 3 * _ring_s(experts / c.ep, efsdp, _link(w, hw, n))
    per_micro += (shard > 1) * 3 * s.num_layers * COLLECTIVE_LATENCY_S  # one of each per layer
    hidden += overlap * per_micro * micro_steps
    exposed += (1 - overlap) * per_micro * micro_steps
    if c.hybrid:  # each GPU all-reduces its gradient shard with its peers on the other machines, over its own adapter
        replicate = 2 * _ring_s(grads / c.tp / shard, w.num_machines, hw.inter_node_bps)
        hidden += overlap * replicate
        exposed += (1 - overlap) * replicate
    if c.tp > 1:  # two all-reduces of the activations per layer forward, two backward, none hidden (no async TP)
        exposed += micro_steps * 4 * s.num_layers * 2 * _ring_s(tokens * s.hidden_size * b, c.tp, hw.intra_node_bps)
    if c.ep > 1:
        exposed += micro_steps * all_to_all_s(w, c, hw, tokens)
    if c.cp > 1:  # the ring passes K and V forward, K, V and their gradients backward, while attention computes
        kv = tokens * 2 * s.num_key_value_heads * s.head_dim * b
        ring = micro_steps * s.num_layers * 3 * (c.cp - 1) * kv / (_link(w, hw, c.cp) * LINK_EFFICIENCY)
        hidden += CP_OVERLAP * ring
        exposed += (1 - CP_OVERLAP) * ring
    return hidden, exposed


def all_to_all_s(w: Workload, c: Candidate, hw: Hardware, tokens: int) -> float:
    """Seconds of one micro-batch's expert dispatch under ep: per MoE layer ALL_TO_ALLS_PER_MOE_LAYER all-to-alls, each
    sending the routed copies of this rank's tokens (t x k x hidden) but the 1/ep staying home, over the links to its
    peers, plus a fixed cost per peer (NCCL's all-to-all is ep - 1 point-to-point sends): the term that grows
    with ep."""
    s = w.shapes
    if c.ep <= 1 or not s.is_moe:
        return 0.0
    routed = tokens * s.experts_per_token * s.hidden_size * w.weight_bytes
    # the peers on this machine over NVLink/PCIe; those on other machines over this GPU's own network adapter (an
    # all-to-all has no ring whose traffic the machine's adapters could share)
    local = min(c.ep, w.gpus_per_machine)
    one = routed * (local - 1) / c.ep / (hw.intra_node_bps * LINK_EFFICIENCY)
    one += routed * (c.ep - local) / c.ep / (hw.inter_node_bps * LINK_EFFICIENCY)
    one += (c.ep - 1) * COLLECTIVE_LATENCY_S
    return s.moe_layers * ALL_TO_ALLS_PER_MOE_LAYER * one


def _offload_s(w: Workload, c: Candidate, hw: Hardware, micro_steps: int) -> float:
    """PCIe traffic of CPU offload and the CPU optimizer step (not overlapped: the step waits for it)."""
    if not (c.offload_optimizer or c.offload_params):
        return 0.0
    n, trainable = w.world_size, w.trainable_params
    shard = trainable / (n if c.zero_stage or c.engine == "fsdp" else 1)
    # gradients (fp32) down, updated 16-bit weights up; the CPU steps every GPU's shard of this machine at once
    seconds = shard * (4 + w.weight_bytes) / hw.host_pcie_bps
    seconds += shard * w.gpus_per_machine * OPTIMIZER_BYTES / hw.cpu_memory_bps
    if c.offload_params:  # the weights cross PCIe forward and backward of every micro-batch
        seconds += micro_steps * 2 * w.shapes.total_params / n * 4 / hw.host_pcie_bps
    return seconds


def _save_s(w: Workload, c: Candidate, hw: Hardware) -> float:
    """Weights (16-bit) and fp32 weights + AdamW moments; sharded engines write every machine's part at once,
    DDP writes from rank 0 alone."""
    nbytes = w.weight_bytes * w.shapes.total_params + 12 * w.trainable_params
    machines = 1 if c.engine == "ddp" else w.num_machines
    return nbytes / machines / hw.storage_write_bps


def step_time(
    w: Workload,
    c: Candidate,
    hw: Hardware,
    *,
    recompute: Recompute | None = None,
    micro_steps: int = 1,
    compiled: bool = False,
    fp8: bool = False,
    fp8_all_gather: bool = False,
) -> StepTime:
    """The predicted step of ``c`` (``micro_steps`` micro-batches accumulated per optimizer step); ``compiled``
    (torch.compile), ``fp8`` (float8 linears) and ``fp8_all_gather`` describe published runs of other trainers (the
    planner's own candidates run eager bf16)."""
    recompute = recompute or ("full" if c.activation_checkpointing else "none")
    # tokens one GPU holds per micro-batch: TP ranks share the sequences, CP ranks split them
    tokens = w.micro_batch_size * w.cp_seq_len(c.cp) // c.cp
    k = hw.step_correction  # `plan --calibrate`: measured / predicted of a run on this hardware, on every term
    compute, flops = _compute_s(w, c, hw, recompute, tokens, compiled, fp8)
    hidden, exposed = (k * t for t in _communication_s(w, c, hw, tokens, micro_steps, fp8_all_gather))
    compute *= micro_steps * k
    communication = max(0.0, hidden - compute) + exposed
    shard = w.trainable_params / (1 if c.engine == "ddp" else w.world_size / c.tp)
    optimizer = 0.0 if c.offload_optimizer or c.offload_params else k * shard * OPTIMIZER_BYTES / hw.hbm_bps
    return StepTime(
        compute_s=compute,
        communication_s=communication,
        communication_total_s=hidden + exposed,
        optimizer_s=optimizer,
        offload_s=k * _offload_s(w, c, hw, micro_steps),
        tokens_per_gpu=micro_steps * tokens / c.tp,
        model_flops_per_gpu=micro_steps * flops,
        peak_flops=peak_flops(w, hw),
        save_s=_save_s(w, c, hw),
    )
