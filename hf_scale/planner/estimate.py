"""Per-GPU (and per-machine CPU) memory of one training step, for every candidate strategy.

Everything is in bytes and split the way memory is actually held:

``params``     the weights the GPU keeps between steps (all of them, or this rank's shard)
``grads``      gradient storage kept until the optimizer step (full, or this rank's partition)
``optimizer``  fp32 master weights (DeepSpeed keeps them even in fp32 training) + optimizer states
``activations`` tensors saved for backward by the decoder layers (formula in :func:`activation_bytes`)
``logits``     the vocabulary-sized tensors of the loss (:func:`logits_bytes`)
``buffers``    communication buckets and transient copies: DDP gradient buckets and autocast's weight
               cache, ZeRO reduce buckets, ZeRO-1's unreduced gradients during backward, DeepSpeed's
               step-time fp32 gradient partition, layers all-gathered by ZeRO-3/FSDP

FSDP2 x TP / x CP candidates (hf_scale.planner.parallel) are estimated by :func:`fsdp_parallel_estimate`.

``params + grads + optimizer`` of the DeepSpeed candidates is *exactly* what the engine holds on each rank
after backward (tests/planner/test_planner_deepspeed.py checks it to the byte on 2 processes, ZeRO-1/2/3, which is
why ZeRO-1/2 pad to 2 x world elements and ZeRO-3 pads each parameter to the world size, as DeepSpeed does).

Differences from DeepSpeed's ``estimate_zero2/zero3_model_states_mem_needs`` (deliberate):
* no ``additional_buffer_factor`` of 1.5 on CPU memory: the planner applies one safety margin to the total;
* no load-time CPU term (4 bytes x params x GPUs when every process loads the fp32 model before
  partitioning): the generated configs load with zero.Init / cpu_ram_efficient_loading;
* DeepSpeed counts the fp32 gradient partition (4 bytes/param) inside the GPU model states; here it is a
  step-time transient in ``buffers`` (it exists only during ``step()``). The totals agree: ZeRO-2 bf16 is
  2 + 18/N bytes per parameter both ways, and the CPU side of every offload variant is the same;
* ZeRO-3 without offload: DeepSpeed's 18/N leaves out the 16-bit gradient partition
  (``grad_partitions_flat_buffer``, which the 2-process test measures on the real engine), so here it is
  20/N, plus the persistent small parameters kept whole;
* ZeRO-3 live parameters: DeepSpeed takes 4 bytes x the largest module; here two decoder layers (the
  current one and the prefetched one) or the largest module, whichever is larger, plus its gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Literal

from hf_scale.knowledge.model_shapes import ModelShapes

Precision = Literal["no", "fp16", "bf16"]
OptimizerName = Literal["adamw", "adamw_8bit", "sgd"]

# Per trainable parameter, in bytes. AdamW: exp_avg + exp_avg_sq in fp32. bitsandbytes' 8-bit AdamW: the
# two states in one byte each (its per-block quantisation constants, 8 bytes per 2048 values, are ignored).
# sgd is torch.optim.SGD as the HF Trainer builds it (no momentum): no state.
OPTIMIZER_STATE_BYTES: dict[str, int] = {"adamw": 8, "adamw_8bit": 2, "sgd": 0}
FP32 = 4
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
"""Bytes per weight of bitsandbytes' NF4 with double quantization (QLoRA section 3, what train.py --load_in_4bit
loads): 4 bits, an 8-bit scale per 64 weights, an fp32 constant per 256 scales."""
# DeepSpeed ZeRO-1/2 pad each flat parameter group to a multiple of this x world size
# (nccl_start_alignment_factor in deepspeed/runtime/zero/stage_1_and_2.py).
DEEPSPEED_ALIGNMENT_FACTOR = 2


@dataclass(frozen=True)
class Candidate:
    """One way to run the job."""

    key: str
    """The strategy catalogue's name of this setup (hf_scale.config.presets, sizes by its sized_name rule), also the
    default
    name of generated files, e.g. zero3_offload or fsdp2_tp4."""
    label: str
    """Human-readable name for tables."""
    engine: Literal["ddp", "deepspeed", "fsdp"]
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    hybrid: bool = False
    """FSDP2 hybrid shard: shard within a machine, replicate across machines."""
    activation_checkpointing: bool = False
    tp: int = 1
    """Tensor-parallel degree (FSDP2 x TP, hf_scale.planner.parallel)."""
    cp: int = 1
    """Context-parallel degree (FSDP2 x CP)."""
    ep: int = 1
    """Expert-parallel degree of an MoE model (FSDP2 x EP): the routed experts split over ep ranks."""


@dataclass(frozen=True)
class Workload:
    """The job: model, hardware and training choices."""

    shapes: ModelShapes
    gpus_per_machine: int
    num_machines: int
    seq_len: int
    micro_batch_size: int
    precision: Precision = "bf16"
    optimizer: OptimizerName = "adamw"
    lora_r: int | None = None
    """LoRA rank; None = full fine-tune."""
    load_in_4bit: bool = False
    """QLoRA: the frozen base's linear weights in 4-bit NF4 (needs lora_r)."""
    zero3_persistence_threshold: int | None = None
    """ZeRO-3 keeps parameters with fewer elements than this gathered; None = the "auto" value the HF
    Trainer fills in (10 x hidden_size)."""

    @property
    def world_size(self) -> int:
        return self.gpus_per_machine * self.num_machines

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch on one GPU."""
        return self.micro_batch_size * self.seq_len

    def cp_seq_len(self, cp: int) -> int:
        """The sequence length a run with context parallelism ``cp`` trains: train.py's CP collator
        (hf_scale.train.model.context_parallel.Collator) pads every batch on the right to a multiple of 2 x cp, the
        chunks load-balanced ring attention cuts each sequence into. ``seq_len`` itself without CP."""
        multiple = 2 * cp if cp > 1 else 1
        return _ceil_div(self.seq_len, multiple) * multiple

    @property
    def weight_bytes(self) -> int:
        """Bytes per element of 16-bit-capable tensors (weights, activations) under this precision."""
        return FP32 if self.precision == "no" else 2

    @property
    def trainable_params(self) -> int:
        return self.shapes.lora_params(self.lora_r) if self.lora_r else self.shapes.total_params

    @property
    def frozen_params(self) -> int:
        """LoRA's frozen base (no gradients, no optimizer states)."""
        return self.shapes.total_params if self.lora_r else 0

    @property
    def frozen_bytes(self) -> int:
        """Bytes of the frozen base: the compute dtype, or the decoder layers' linear weights quantized."""
        if not self.load_in_4bit:
            return self.weight_bytes * self.frozen_params
        linear = self.shapes.linear_params
        return int(NF4_BYTES * linear) + self.weight_bytes * (self.frozen_params - linear)

    @property
    def layer_bytes(self) -> int:
        """Bytes of one decoder layer as ZeRO-3/FSDP gather it (its linear weights quantized under QLoRA)."""
        s = self.shapes
        if not self.load_in_4bit:
            return self.weight_bytes * s.decoder_layer_params
        linear = s.linear_params // s.num_layers
        return int(NF4_BYTES * linear) + self.weight_bytes * (s.decoder_layer_params - linear)


@dataclass(frozen=True)
class Estimate:
    """Bytes per GPU by category, plus CPU RAM per machine for offloaded state."""

    candidate: Candidate
    params: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    buffers: int
    cpu_per_machine: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer (master weights and states) held on the GPU."""
        return self.params + self.grads + self.optimizer

    @property
    def gpu_total(self) -> int:
        return self.model_states + self.activations + self.logits + self.buffers

    def breakdown(self) -> dict[str, int]:
        names = ("params", "grads", "optimizer", "activations", "logits", "buffers")
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in names}


def activation_bytes(w: Workload, *, checkpointing: bool) -> int:
    """Activations saved for backward on one GPU for one micro-batch (t = micro_batch_size x seq_len tokens).

    Per decoder layer and token, with h = hidden, i = intermediate, kv = num_key_value_heads x head_dim,
    a = bytes of the compute dtype (2 under bf16/fp16, 4 in fp32), Llama layers as transformers runs them:

    * 2 x RMSNorm: the fp32 upcast of the input (4h) and the normalised output fed to the next matmul (a h)
    * attention: q (a h), k and v after grouped-query projection (2 a kv), sdpa/flash output (a h) that is
      also o_proj's input. Flash/memory-efficient sdpa saves only a logsumexp per head, so there is no
      seq_len^2 term
    * SwiGLU MLP: gate and up projections (2 a i), silu(gate) (a i), and the product fed to down_proj (a i); in a
      mixture-of-experts model i is the width of the experts a token runs through (ModelShapes.mlp_width: top-k
      routed plus shared), plus the router's and the dispatch's tensors (:func:`moe_token_bytes`)

    per_layer = 2 (4 + a) h + a (2h + 2kv) + 4 a i (+ the MoE term).  Without checkpointing all layers keep theirs:
    L x per_layer x t, plus the embedding output and final norm (a h + 4 h) x t. With activation
    checkpointing each layer keeps only its input (a h), and one layer's full set is alive while it is
    recomputed in backward: (L a h + per_layer) x t.
    """
    s = w.shapes
    a, h, i = w.weight_bytes, s.hidden_size, s.mlp_width
    kv = s.num_key_value_heads * s.head_dim
    per_layer = 2 * (FP32 + a) * h + a * (2 * h + 2 * kv) + 4 * a * i + moe_token_bytes(w)
    if checkpointing:
        return (s.num_layers * a * h + per_layer) * w.tokens
    return (s.num_layers * per_layer + (a + FP32) * h) * w.tokens


def moe_token_bytes(w: Workload) -> int:
    """Per token, averaged over the decoder layers, what an MoE layer saves beyond its experts' activations: the
    router's logits and their fp32 softmax (2 x 4 x experts), the token's copies permuted to its top-k experts and
    their outputs before the weighted sum (2 x a x k x hidden). 0 for a dense model."""
    s = w.shapes
    if not s.is_moe:
        return 0
    per_moe_layer = 2 * FP32 * s.num_experts + 2 * w.weight_bytes * s.experts_per_token * s.hidden_size
    return per_moe_layer * s.moe_layers // s.num_layers


def dispatch_bytes(w: Workload, tokens: int, ep: int) -> int:
    """The all-to-all buffers of one MoE layer under expert parallelism: the routed copies of this rank's tokens
    sent out and the ones its experts receive (t x k x hidden each, balanced routing; transformers' all_to_all path is
    dropless, so an unbalanced router makes the receiving side larger)."""
    s = w.shapes
    return 0 if ep <= 1 or not s.is_moe else 2 * w.weight_bytes * tokens * s.experts_per_token * s.hidden_size


def logits_bytes(w: Workload) -> int:
    """The loss's vocabulary-sized tensors: lm_head's output in the compute dtype, its fp32 upcast
    (transformers' loss does ``logits.float()``) and cross-entropy's fp32 log-softmax kept for backward:
    t x vocab x (a + 4 + 4). At 128k vocabulary and 4k tokens that is 5 GiB on its own."""
    return w.tokens * w.shapes.vocab_size * (w.weight_bytes + FP32 + FP32)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _zero12_partition(numel: int, world: int) -> int:
    """Elements per rank of a ZeRO-1/2 flat group: padded to DEEPSPEED_ALIGNMENT_FACTOR x world."""
    alignment = DEEPSPEED_ALIGNMENT_FACTOR * world
    return _ceil_div(numel, alignment) * alignment // world


def _zero3_partition(w: Workload, world: int) -> tuple[int, int]:
    """(elements of this rank's partition, elements of persistent parameters kept whole).

    ZeRO-3 partitions every parameter separately (ceil(numel / world) each); parameters below
    stage3_param_persistence_threshold additionally stay gathered after their first use. For LoRA the
    adapters are not counted here: only the frozen base's shapes are known per tensor."""
    threshold = w.zero3_persistence_threshold
    if threshold is None:
        threshold = 10 * w.shapes.hidden_size
    numels = w.shapes.param_numels
    return sum(_ceil_div(n, world) for n in numels), sum(n for n in numels if n < threshold)


def estimate(w: Workload, c: Candidate) -> Estimate:
    """Memory of candidate ``c`` for workload ``w`` (a CP candidate at the length it pads to)."""
    w = replace(w, seq_len=w.cp_seq_len(c.cp))
    activations = activation_bytes(w, checkpointing=c.activation_checkpointing)
    logits = logits_bytes(w)
    if c.engine == "ddp":
        return _ddp(w, c, activations, logits)
    if c.engine == "fsdp" and (c.tp > 1 or c.cp > 1 or c.ep > 1 or c.offload_params):
        return fsdp_parallel_estimate(w, c, logits)
    if c.engine == "fsdp":
        return _fsdp(w, c, activations, logits)
    return _deepspeed(w, c, activations, logits)


def _ddp(w: Workload, c: Candidate, activations: int, logits: int) -> Estimate:
    # accelerate's DDP keeps the trainable weights in fp32 and autocasts; the frozen LoRA base is assumed
    # loaded in the compute dtype (it needs no fp32 master).
    trainable = w.trainable_params
    state = OPTIMIZER_STATE_BYTES[w.optimizer]
    # DDP copies gradients into its own flat buckets (gradient_as_bucket_view=False, the default), and
    # autocast caches a 16-bit copy of every trainable weight for the whole forward.
    autocast_cache = trainable * w.weight_bytes if w.precision != "no" else 0
    return Estimate(
        c,
        params=FP32 * trainable + w.frozen_bytes,
        grads=FP32 * trainable,
        optimizer=state * trainable,
        activations=activations,
        logits=logits,
        buffers=FP32 * trainable + autocast_cache,
    )


def _fsdp(w: Workload, c: Candidate, activations: int, logits: int) -> Estimate:
    # FSDP2 (fully_shard per decoder layer, then the root) with accelerate's MixedPrecisionPolicy: fp32
    # shards, 16-bit all-gathered parameters, gradients reduce-scattered in fp32.
    shards = w.gpus_per_machine if c.hybrid else w.world_size
    s = w.shapes
    trainable = w.trainable_params
    state = OPTIMIZER_STATE_BYTES[w.optimizer]
    a = w.weight_bytes
    root = s.total_params - s.num_layers * s.decoder_layer_params  # embeddings, final norm, lm_head
    # Gathered: the root unit (not resharded after forward) and two layers (current + prefetched), plus the
    # unsharded fp32 gradient of one layer waiting for its reduce-scatter.
    gathered = a * root + 2 * w.layer_bytes + FP32 * s.decoder_layer_params
    return Estimate(
        c,
        params=_ceil_div(FP32 * trainable + w.frozen_bytes, shards),
        grads=_ceil_div(FP32 * trainable, shards),
        optimizer=_ceil_div(state * trainable, shards),
        activations=activations,
        logits=logits,
        buffers=gathered,
        notes=(f"sharded over {shards} GPUs",),
    )


def _deepspeed(w: Workload, c: Candidate, activations: int, logits: int) -> Estimate:
    s, world, a = w.shapes, w.world_size, w.weight_bytes
    trainable = w.trainable_params
    state = OPTIMIZER_STATE_BYTES[w.optimizer]
    bucket = a * s.hidden_size**2  # reduce_bucket_size "auto" = hidden_size^2 elements
    if c.zero_stage == 3:
        base_part, persistent = _zero3_partition(w, world)
        lora_part = _ceil_div(trainable, world) if w.lora_r else 0
        part = lora_part if w.lora_r else base_part
        held_params = a * (base_part + lora_part + persistent)
        if w.load_in_4bit:
            # transformers never loads a quantized model inside zero.Init: each GPU holds the whole quantized base
            # until DeepSpeed partitions it (the peak, counted here), and the gathered layers are quantized.
            held_params = w.frozen_bytes + a * lora_part
        live = max(2 * w.layer_bytes, a * s.largest_layer_params)
        buffers = live + max(w.layer_bytes, a * s.largest_layer_params) + bucket
    else:
        part = _zero12_partition(trainable, world)
        held_params = w.frozen_bytes + a * trainable if w.lora_r else a * s.total_params
        # ZeRO-1 keeps every unreduced gradient until the end of backward; ZeRO-2 reduces as it goes.
        unreduced = a * (trainable - part) if c.zero_stage == 1 else 0
        buffers = 2 * bucket + unreduced  # overlap_comm double-buffers the reduce bucket
    cpu_rank = 0
    master_and_states = (FP32 + state) * part
    if c.offload_optimizer:
        # Master weights, states and the fp32 gradient partition live in (pinned) CPU RAM.
        cpu_rank += master_and_states + FP32 * part
        master_and_states, grads = 0, 0
    else:
        grads = a * part
        buffers += FP32 * part  # step(): fp32 copy of the gradient partition
    if c.offload_params:
        cpu_rank += held_params - a * persistent
        held_params = a * persistent
    return Estimate(
        c,
        params=held_params,
        grads=grads,
        optimizer=master_and_states,
        activations=activations,
        logits=logits,
        buffers=buffers,
        cpu_per_machine=cpu_rank * w.gpus_per_machine,
    )


def parallel_activation_bytes(w: Workload, *, checkpointing: bool, tp: int, cp: int) -> int:
    """activation_bytes with the tokens split over cp and the TP-split tensors over tp (transformers' Llama tp_plan:
    the norms' inputs stay whole on each TP rank)."""
    s = w.shapes
    a, h, i = w.weight_bytes, s.hidden_size, s.mlp_width
    kv = s.num_key_value_heads * s.head_dim
    tokens = _ceil_div(w.tokens, cp)
    # Norms (fp32 upcast + output) stay whole on each TP rank; q, k, v, attention output and the MLP are split.
    per_layer = 2 * (FP32 + a) * h + _ceil_div(a * (2 * h + 2 * kv) + 4 * a * i, tp) + moe_token_bytes(w)
    if checkpointing:
        return (s.num_layers * a * h + per_layer) * tokens
    return (s.num_layers * per_layer + (a + FP32) * h) * tokens


def fsdp_parallel_estimate(w: Workload, c: Candidate, logits: int) -> Estimate:
    """Memory of an FSDP2 candidate with TP/CP/EP (and optionally FSDP2's CPU offload). Under EP the model states
    are still split over every rank (each expert over ep x dp_shard x tp / ep ranks: transformers' efsdp), but a
    layer gathers only this rank's 1/ep of its routed experts, and the all-to-all buffers join the buffers."""
    s = w.shapes
    replicas = w.num_machines if c.hybrid else 1
    shards = w.world_size // replicas  # dp_shard x cp x tp: every rank of a replica holds a distinct piece
    trainable, frozen = w.trainable_params, w.frozen_params
    a, state = w.weight_bytes, OPTIMIZER_STATE_BYTES[w.optimizer]
    embed = s.vocab_size * s.hidden_size
    root = s.total_params - s.num_layers * s.decoder_layer_params
    # Gathered over dp_shard x cp: the root (embedding whole, lm_head split over tp) and two TP-split layers,
    # plus one layer's fp32 gradient before its reduce-scatter.
    experts = s.expert_layer_params
    # the routed experts: split over ep by the EP plan (which takes them from the TP plan), else over tp
    layer = _ceil_div(s.decoder_layer_params - experts, c.tp) + _ceil_div(experts, c.ep if c.ep > 1 else c.tp)
    gathered = a * (embed + _ceil_div(root - embed, c.tp) + 2 * layer) + FP32 * layer
    gathered += dispatch_bytes(w, _ceil_div(w.tokens, c.cp), c.ep)
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
        activations=parallel_activation_bytes(w, checkpointing=c.activation_checkpointing, tp=c.tp, cp=c.cp),
        logits=_ceil_div(logits, c.cp),
        buffers=gathered,
        cpu_per_machine=cpu,
        notes=(f"sharded over {shards} GPUs (tp={c.tp}, cp={c.cp}{f', ep={c.ep}' if c.ep > 1 else ''})",),
    )
