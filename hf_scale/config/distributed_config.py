"""The one typed configuration every generated file is derived from.

A :class:`DistributedConfig` is loaded from YAML (:func:`load_config`) or a preset (`presets.load_preset`),
optionally with dotted ``key=value`` overrides, and validated completely before anything is generated: unknown keys,
wrong types and every cross-field inconsistency become a one-line :class:`~hf_scale.errors.UserError`
naming the dotted field, the value and what is allowed. The fields' value types (bounds, strict numbers, safe
host names and paths) are `config_types.py`'s.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    model_validator,
)

from hf_scale.config.cluster_section import ClusterConfig
from hf_scale.config.error_line import one_line, show
from hf_scale.config.parallelism import Layout, ParallelismSettings, checked_layout, config_layout, layout_warnings
from hf_scale.config.value_types import (
    MAX_BATCH,
    MAX_MACHINES,
    MAX_PROCESSES_PER_MACHINE,
    AutoOrPositiveInt,
    BatchSize,
    Beta,
    ClassName,
    Elements,
    Host,
    LocalPath,
    Number,
    OffloadDevice,
    Precision,
    StrictInt,
    int_choice,
)
from hf_scale.errors import UserError
from hf_scale.files.reading import load_yaml, read_text
from hf_scale.knowledge import precision_rules
from hf_scale.knowledge.rules import global_batch_size

Strategy = Literal["single", "ddp", "deepspeed", "fsdp"]


class _Section(BaseModel):
    # Attribute docstrings become the JSON Schema descriptions, so editors show them on hover.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)


class BatchConfig(_Section):
    """Batch arithmetic. Any two of the three determine the third given the world size; with fewer than
    two, a missing micro_batch_size and gradient_accumulation_steps default to 1. After validation all
    three are integers."""

    global_batch_size: BatchSize | None = None
    """Samples per optimizer step, all processes together (= micro_batch_size x gradient_accumulation_steps
    x data-parallel size, the world size divided by parallelism.tp x cp x sp)."""
    micro_batch_size: BatchSize | None = None
    """Samples per process per forward/backward pass (DeepSpeed's train_micro_batch_size_per_gpu, the
    Trainer's --per_device_train_batch_size)."""
    gradient_accumulation_steps: BatchSize | None = None
    """Forward/backward passes per optimizer step."""


class TopologyConfig(_Section):
    """Machines and processes."""

    num_machines: Annotated[StrictInt, Field(ge=1, le=MAX_MACHINES)] = 1
    """Number of machines (nodes)."""
    processes_per_machine: Annotated[StrictInt, Field(ge=1, le=MAX_PROCESSES_PER_MACHINE)] = 1
    """Processes (usually GPUs) PER MACHINE. accelerate's num_processes is the TOTAL
    (num_machines x processes_per_machine); the generators write that total."""
    machine_rank: Annotated[StrictInt, Field(ge=0)] = 0
    """Rank of this machine, 0..num_machines-1 (launch scripts override it per node, e.g. from
    $SLURM_NODEID)."""
    main_process_ip: Host | None = None
    """Address of the rank-0 machine (IPv4/IPv6 address or DNS host name); required when num_machines > 1."""
    main_process_port: Annotated[StrictInt, Field(ge=1, le=65535)] = 29500
    """TCP port of the rendezvous on the rank-0 machine (1-65535)."""
    rdzv_backend: Literal["static", "c10d"] = "static"
    """torchrun rendezvous: static (fixed ranks, master_addr/port) or c10d (elastic rendezvous endpoint)."""
    same_network: StrictBool = True
    """Whether all machines share a local network (accelerate passes master_addr/port directly)."""


class OptimizerConfig(_Section):
    """AdamW hyper-parameters of the DeepSpeed JSON's optimizer block (when it has one: see
    deepspeed.fused_adam): concrete in "resolved" mode; in "auto" mode the HF Trainer fills them from
    --learning_rate/--adam_beta1/--adam_beta2/--adam_epsilon/--weight_decay."""

    lr: Annotated[Number, Field(gt=0)] = 2.0e-5
    """Peak learning rate."""
    weight_decay: Annotated[Number, Field(ge=0)] = 0.0
    """Decoupled weight decay."""
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    """Adam betas [beta1, beta2], each in [0, 1)."""
    eps: Annotated[Number, Field(gt=0)] = 1.0e-8
    """Adam epsilon."""


class DeepSpeedSettings(_Section):
    """DeepSpeed ZeRO settings (used when strategy is deepspeed, ignored otherwise)."""

    zero_stage: Annotated[Literal[0, 1, 2, 3], BeforeValidator(int_choice)] = 2
    """ZeRO stage: 0 off, 1 optimizer states, 2 + gradients, 3 + parameters sharded."""
    offload_optimizer: OffloadDevice = "none"
    """Offload optimizer states: none | cpu (stages 1-3) | nvme (stage 3, ZeRO-Infinity)."""
    offload_params: OffloadDevice = "none"
    """Offload parameters: none | cpu | nvme (stage 3 only)."""
    nvme_path: LocalPath | None = None
    """Local NVMe directory (an absolute path) for nvme offload; required when either offload is nvme."""
    pin_memory: StrictBool = True
    """Pin the CPU/NVMe offload buffers (faster transfers, more page-locked RAM)."""
    overlap_comm: StrictBool = True
    """Overlap gradient reduction with the backward pass."""
    contiguous_gradients: StrictBool = True
    """Copy gradients into one contiguous buffer (less fragmentation)."""
    reduce_bucket_size: AutoOrPositiveInt = "auto"
    """Elements reduced at once; "auto" = hidden_size^2 (HF Trainer/accelerate fill it from the model)."""
    allgather_bucket_size: Elements = 500_000_000
    """Elements all-gathered at once (stages 1 and 2)."""
    stage3_prefetch_bucket_size: AutoOrPositiveInt = "auto"
    """Stage 3: elements prefetched ahead; "auto" = 0.9 x hidden_size^2."""
    stage3_param_persistence_threshold: AutoOrPositiveInt = "auto"
    """Stage 3: parameters smaller than this stay unpartitioned; "auto" = 10 x hidden_size."""
    stage3_max_live_parameters: Elements = 1_000_000_000
    """Stage 3: maximum parameters resident on a GPU before releasing."""
    stage3_max_reuse_distance: Elements = 1_000_000_000
    """Stage 3: do not release a parameter reused within this many parameters."""
    sub_group_size: Elements = 1_000_000_000
    """Stage 3: optimizer step granularity in elements (lower it if CPU/NVMe offload runs out of memory)."""
    zero3_init: StrictBool = True
    """Build the model already partitioned (deepspeed.zero.Init) under ZeRO-3, so no process holds it
    whole."""
    gather_16bit_weights_on_save: StrictBool = True
    """Stage 3: gather the full 16-bit weights when saving (stage3_gather_16bit_weights_on_model_save), so
    train.py ends with a safetensors model. False (no gather onto one process at the end, e.g. 70B): train.py ends
    with the final step's DeepSpeed checkpoint instead, which `hf-scale export` turns into safetensors."""
    torch_adam: StrictBool = False
    """Write a DeepSpeed `optimizer` block whose AdamW is torch.optim.AdamW (no compiled DeepSpeed op, also
    under optimizer offload: slower than DeepSpeedCPUAdam but needs no C++ compiler)."""
    fused_adam: StrictBool = False
    """Write a DeepSpeed `optimizer` block without offload too, so DeepSpeed runs its own FusedAdam (a CUDA
    op: prebuilt, or JIT-built with nvcc and a valid TORCH_CUDA_ARCH_LIST). Default false: without offload
    the training loop's torch AdamW (fused on GPU) runs and nothing is compiled; with optimizer offload
    DeepSpeedCPUAdam runs either way (a C++ op, checked before the model loads)."""


class FSDPSettings(_Section):
    """PyTorch FSDP settings, applied through accelerate (used when strategy is fsdp)."""

    version: Annotated[Literal[1, 2], BeforeValidator(int_choice)] = 2
    """FSDP implementation: 2 (fully_shard, recommended) or 1 (legacy FullyShardedDataParallel)."""
    sharding: Literal["full_shard", "shard_grad_op", "hybrid_shard", "no_shard"] = "full_shard"
    """full_shard (params+grads+optimizer), shard_grad_op (params kept after forward), hybrid_shard (shard
    within a machine, replicate across machines), no_shard (FSDP1 only; use strategy ddp instead)."""
    transformer_layer_cls_to_wrap: list[ClassName] = Field(default_factory=list, max_length=64)
    """Decoder layer class names wrapped as FSDP units, e.g. [LlamaDecoderLayer]; empty = the model's
    _no_split_modules."""
    state_dict_type: Literal["sharded", "full"] = "sharded"
    """Checkpoint format: sharded (fast, per-rank files) or full (one consolidated state dict on rank 0)."""
    cpu_ram_efficient_loading: StrictBool = True
    """Load the pretrained weights on rank 0 only and broadcast them (saves CPU RAM on large models)."""
    offload_params: StrictBool = False
    """Offload parameters and gradients to CPU."""
    activation_checkpointing: StrictBool = False
    """FSDP's own activation checkpointing of the wrapped layers (do not combine with the top-level
    activation_checkpointing)."""


class FP8Settings(_Section):
    """FP8 training (used when precision is fp8): fp8 matmuls in the large linear layers, bf16 elsewhere."""

    backend: Literal["torchao", "te", "msamp"] = "torchao"
    """torchao (float8 linears, the default) | te (NVIDIA TransformerEngine) | msamp (MS-AMP). Needs a GPU of
    compute capability >= 8.9 (Ada, Hopper) and the backend installed: `pip install hf-scale[fp8]` for torchao."""


class DistributedConfig(_Section):
    """One typed description of a distributed fine-tuning run; every generated file derives from it."""

    strategy: Strategy = "single"
    """single (one process) | ddp (data parallel) | deepspeed (ZeRO) | fsdp (PyTorch FSDP via accelerate)."""
    precision: Precision = "bf16"
    """Mixed precision: no | fp16 | bf16 | fp8 (bf16 with fp8 matmuls in the large linear layers, see the fp8
    section; GPUs of compute capability >= 8.9). Legacy shorthands `bf16: true` / `fp16: true` are accepted at the
    top level; both true, or one disagreeing with precision, is an error."""
    gradient_clipping: Annotated[Number, Field(gt=0)] | None = 1.0
    """Clip the global gradient norm to this value; null turns clipping off."""
    activation_checkpointing: StrictBool = False
    """Gradient (activation) checkpointing of the model's layers, trading compute for memory."""
    batch: BatchConfig = Field(default_factory=BatchConfig)
    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    deepspeed: DeepSpeedSettings = Field(default_factory=DeepSpeedSettings)
    fsdp: FSDPSettings = Field(default_factory=FSDPSettings)
    fp8: FP8Settings = Field(default_factory=FP8Settings)
    parallelism: ParallelismSettings = Field(default_factory=ParallelismSettings)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Kubernetes, SkyPilot, Ray and the container image (`hf-scale generate --targets`):
    hf_scale.config.cluster_section."""

    @property
    def world_size(self) -> int:
        """Total processes: num_machines x processes_per_machine."""
        return self.topology.num_machines * self.topology.processes_per_machine

    @property
    def layout(self) -> Layout:
        """The resolved dp_replicate x dp_shard x tp x cp x sp (validation already checked it)."""
        return config_layout(self)

    @model_validator(mode="before")
    @classmethod
    def _legacy_precision_flags(cls, data: Any) -> Any:
        # `bf16: true` / `fp16: true` are what HF Trainer users type; they are folded into `precision`
        # here (they are not fields) so the cross-field checks below only ever see `precision`.
        if not isinstance(data, dict) or not ({"bf16", "fp16"} & data.keys()):
            return data
        data = dict(data)
        flags = {name: data.pop(name) for name in ("bf16", "fp16") if name in data}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise ValueError(
                    f"{name}={show(value)} is invalid: the legacy shorthand must be true or false"
                )
        enabled = [name for name, value in flags.items() if value]
        if len(enabled) == 2:
            raise ValueError(
                "bf16=true and fp16=true together: choose one, e.g. precision: bf16 (allowed: no|fp16|bf16)"
            )
        explicit = data.get("precision")
        if enabled:
            if explicit is not None and explicit != enabled[0]:
                raise ValueError(
                    f"{enabled[0]}=true disagrees with precision={show(explicit)}; keep only precision "
                    "(allowed: no|fp16|bf16)"
                )
            data["precision"] = enabled[0]
        elif explicit in flags:
            raise ValueError(f"{explicit}=false disagrees with precision={explicit}; keep only precision")
        return data

    @model_validator(mode="after")
    def _check_consistency(self) -> DistributedConfig:
        """Every cross-field rule lives here, so the rules read as one list."""
        topo, ds, fsdp = self.topology, self.deepspeed, self.fsdp
        world = self.world_size
        if topo.machine_rank >= topo.num_machines:
            raise ValueError(
                f"topology.machine_rank={topo.machine_rank} is out of range: allowed "
                f"0..{topo.num_machines - 1} (topology.num_machines={topo.num_machines})"
            )
        if topo.num_machines > 1 and not topo.main_process_ip:
            raise ValueError(
                f"topology.main_process_ip is required when topology.num_machines={topo.num_machines} > 1: "
                "the address of the rank-0 machine"
            )
        if self.strategy == "single" and world > 1:
            raise ValueError(
                f"strategy=single runs one process but the topology has world_size={world} "
                f"({topo.num_machines} machines x {topo.processes_per_machine} processes); use strategy "
                "ddp, deepspeed or fsdp, or topology.processes_per_machine=1"
            )
        if ds.torch_adam and ds.fused_adam:
            raise ValueError(
                "deepspeed.torch_adam=true and deepspeed.fused_adam=true together: choose torch's AdamW or "
                "DeepSpeed's compiled Adam, not both"
            )
        if self.strategy == "deepspeed":
            if ds.offload_params != "none" and ds.zero_stage < 3:
                raise ValueError(
                    f"deepspeed.offload_params={ds.offload_params} needs deepspeed.zero_stage=3 "
                    f"(got {ds.zero_stage}); only stage 3 partitions parameters"
                )
            if ds.offload_optimizer != "none" and ds.zero_stage == 0:
                raise ValueError(
                    f"deepspeed.offload_optimizer={ds.offload_optimizer} needs deepspeed.zero_stage 1, 2 "
                    "or 3 (got 0)"
                )
            if ds.offload_optimizer == "nvme" and ds.zero_stage < 3:
                # Stages 1/2 treat any offload device as "cpu": NVMe would be silently ignored.
                raise ValueError(
                    f"deepspeed.offload_optimizer=nvme needs deepspeed.zero_stage=3 (got {ds.zero_stage}); "
                    "stages 1-2 only offload to cpu"
                )
            nvme_users = [
                name for name in ("offload_optimizer", "offload_params") if getattr(ds, name) == "nvme"
            ]
            if nvme_users and not ds.nvme_path:
                raise ValueError(
                    f"deepspeed.nvme_path is required when deepspeed.{nvme_users[0]}=nvme: a local NVMe "
                    "directory, e.g. /local_nvme"
                )
        if self.strategy == "fsdp":
            if fsdp.sharding == "hybrid_shard" and topo.num_machines < 2:
                raise ValueError(
                    "fsdp.sharding=hybrid_shard needs topology.num_machines >= 2 (shard within a machine, "
                    f"replicate across machines; got {topo.num_machines}); use full_shard on one machine"
                )
            if fsdp.sharding == "hybrid_shard" and fsdp.version == 2 and topo.processes_per_machine < 2:
                raise ValueError(
                    "fsdp.sharding=hybrid_shard with fsdp.version=2 needs topology.processes_per_machine "
                    ">= 2 (a shard group of 1 is plain replication); use strategy ddp"
                )
            if fsdp.sharding == "no_shard" and fsdp.version == 2:
                raise ValueError(
                    "fsdp.sharding=no_shard is not available with fsdp.version=2 (allowed: full_shard, "
                    "shard_grad_op, hybrid_shard); use strategy ddp for unsharded data parallelism"
                )
            if fsdp.activation_checkpointing and self.activation_checkpointing:
                # transformers' Trainer rejects the combination too: the layers would be checkpointed twice.
                raise ValueError(
                    "fsdp.activation_checkpointing=true and activation_checkpointing=true together would "
                    "checkpoint every layer twice; set only one of them"
                )
        if self.precision == "fp8":
            fp8_problem = precision_rules.fp8_config_problem(self)
            if fp8_problem:
                raise ValueError(fp8_problem)
        layout = checked_layout(self)
        # The ranks of one TP/CP/SP group see the same batch: the batch triple counts data-parallel ranks only.
        label = "world_size" if layout.model_parallel_size == 1 else "data_parallel_size"
        self.batch = _resolve_batch(self.batch, layout.data_parallel_size, label)
        return self


def _resolve_batch(batch: BatchConfig, world: int, label: str = "world_size") -> BatchConfig:
    """Fill the batch triple from any two of its members (missing micro/accumulation default to 1)."""
    glob, micro, accum = batch.global_batch_size, batch.micro_batch_size, batch.gradient_accumulation_steps
    if glob is None:
        micro, accum = micro or 1, accum or 1
        glob = global_batch_size(micro, accum, world)
        if glob > MAX_BATCH:
            raise ValueError(
                f"batch.micro_batch_size({micro}) x batch.gradient_accumulation_steps({accum}) x {label}({world}) "
                f"= {glob} samples per optimizer step; allowed at most {MAX_BATCH}"
            )
        return BatchConfig(global_batch_size=glob, micro_batch_size=micro, gradient_accumulation_steps=accum)
    if micro is None and accum is None:
        micro = 1
    shown_micro = "?" if micro is None else str(micro)
    shown_accum = "?" if accum is None else str(accum)
    known = global_batch_size(micro or 1, accum or 1, world)
    arithmetic = (
        f"batch.global_batch_size={glob} is not micro_batch_size({shown_micro}) x "
        f"gradient_accumulation_steps({shown_accum}) x {label}({world})"
    )
    if micro is not None and accum is not None:
        if glob != known:
            raise ValueError(f"{arithmetic} = {known}; drop one of the three or make them agree")
        return batch
    if glob % known:
        below, above = (glob // known) * known, (glob // known + 1) * known
        suggestion = f"{below} or {above}" if below else str(above)
        raise ValueError(
            f"{arithmetic} = {known} x k for a whole k; allowed: a multiple of {known}, e.g. {suggestion}"
        )
    missing = glob // known
    return BatchConfig(
        global_batch_size=glob,
        micro_batch_size=micro or missing,
        gradient_accumulation_steps=accum or missing,
    )


def config_warnings(cfg: DistributedConfig) -> list[str]:
    """Risky-but-legal choices, one line each (``hf-scale generate`` prints them to stderr)."""
    warnings = layout_warnings(cfg)
    ds = cfg.deepspeed
    if cfg.strategy == "deepspeed" and ds.zero_stage == 3:
        if cfg.precision == "fp16" and (ds.offload_optimizer != "none" or ds.offload_params != "none"):
            warnings.append(
                "precision=fp16 with ZeRO-3 offload: fp16 loss scaling overflows skip steps and the "
                "offloaded optimizer is slow to recover; prefer precision=bf16 on GPUs that support it"
            )
        if not ds.gather_16bit_weights_on_save:
            warnings.append(
                "deepspeed.gather_16bit_weights_on_save=false with ZeRO-3: train.py saves no safetensors model; "
                "it ends with the final step's sharded DeepSpeed checkpoint (OUTPUT_DIR/checkpoint-STEP), which "
                "`hf-scale export` turns into safetensors (and --push_to_hub is refused)"
            )
        if not ds.zero3_init:
            warnings.append(
                "deepspeed.zero3_init=false with ZeRO-3: every process loads the whole model before it is "
                "partitioned (CPU RAM x processes_per_machine)"
            )
    return warnings + precision_rules.fp8_config_warnings(cfg)


# --- loading -----------------------------------------------------------------------------------------


def load_config(path: str | Path | None = None, *, overrides: Sequence[str] = ()) -> DistributedConfig:
    """Load a YAML file (or the defaults without one), apply dotted ``key=value`` overrides (values parsed
    as YAML), validate. Every failure is a one-line UserError. (A preset: `presets.load_preset`.)"""
    return config_from_data(_read_yaml(Path(path)) if path is not None else {}, overrides)


def config_from_data(data: Any, overrides: Sequence[str] = ()) -> DistributedConfig:
    """A raw config mapping (a YAML file's, a preset's, the planner's) with dotted ``key=value`` overrides applied,
    validated. `data` itself is left as it is."""
    data = copy.deepcopy(data)
    for override in overrides:
        _apply_override(data, override)
    _check_keys(data)
    return validate_config(data)


def _check_keys(data: Any, where: str = "") -> None:
    """YAML allows any key (1, [a, b], null); a config's keys are field names."""
    if not isinstance(data, dict):
        return
    for key, value in data.items():
        if not isinstance(key, str):
            place = f"under {where}" if where else "at the top level"
            raise UserError(f"key {show(key)} ({place}) is not a field name; allowed keys are names such as strategy")
        _check_keys(value, f"{where}.{key}".lstrip("."))


def validate_config(data: Any) -> DistributedConfig:
    """Validate a plain dict; pydantic's multi-line report becomes one UserError line."""
    try:
        return DistributedConfig.model_validate(data)
    except ValidationError as error:
        raise UserError(one_line(error, DistributedConfig)) from None


def _read_yaml(path: Path) -> dict:
    text = read_text(path, "config file", expected="an hf_scale config YAML (hf-scale generate writes one)")
    data = load_yaml(text, f"config file {path}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(
            f"config file {path}: the top level must be a mapping of fields, got {type(data).__name__}"
        )
    return data


def _apply_override(data: dict, override: str) -> None:
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise UserError(
            f"--set {override!r} is invalid: expected KEY=VALUE with a dotted key, e.g. "
            "deepspeed.zero_stage=3"
        )
    try:
        # Not `finite`: the config's own validation names the field of an `.inf` and its range.
        value = load_yaml(raw, f"--set {key}={show(raw)}", finite=False) if raw.strip() else None
    except UserError as error:
        raise UserError(f"{error} (quote strings with ':' or '#')") from None
    node = data
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise UserError(f"--set {key}: {where} is a value ({show(child)}), not a section with sub-keys")
        node = child
    node[parts[-1]] = value
