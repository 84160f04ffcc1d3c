"""One run's facts, decided once before anything is loaded (in the spirit of torchtitan's Trainer, which derives
the accumulation in one block, asserts it and logs one line).

train.py's flags are filled from the launcher (hf_scale.train.setup.reconcile) and become `TrainingArguments`; the
:class:`RunSpec` is built right after, from those and the :class:`~hf_scale.train.setup.distributed.LaunchRequest`,
and is what the loops, the callbacks and the runtime guard read: strategy, world size, batch arithmetic,
precision, loop. Nothing re-derives these from the flags later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_scale.config.parallelism import Layout
from hf_scale.knowledge import rules
from hf_scale.train.setup import guard


@dataclass(frozen=True)
class RunSpec:
    launcher: str
    """Which launcher started the processes: python | torchrun | accelerate | deepspeed."""
    strategy: str
    """single | ddp | deepspeed | fsdp."""
    world_size: int
    """Processes in the job (`WORLD_SIZE`)."""
    loop: str
    """trainer (the HF Trainer) | accelerate (hf_scale's manual loop)."""
    micro_batch_size: int
    """Rows per rank per forward pass (--per_device_train_batch_size)."""
    gradient_accumulation_steps: int
    global_batch_size: int
    """Rows per optimizer step over the whole job: micro x accumulation x data-parallel size (the world size
    unless ranks of a TP group share their batches)."""
    precision: str
    """no | bf16 | fp16 (--bf16 / --fp16, after the launcher's config is followed)."""
    seed: int
    data_seed: int
    """The data order's seed: --data_seed, else --seed (the Trainer's rule, in both loops)."""
    packing: bool
    zero_stage: int | None = None
    zero3_init: bool = False
    """ZeRO-3 builds the model partitioned (the DeepSpeed config is registered before from_pretrained)."""
    fsdp_settings: dict | None = field(default=None, compare=False)
    """The `fsdp` section of a --hf_scale_config when it (not accelerate's YAML) asks for FSDP."""
    fsdp_version: int | None = None
    """The FSDP (1 or 2) the model must be wrapped with (the launch request's); None without FSDP."""
    fp8_backend: str | None = None
    """FP8 training (precision stays bf16: the autocast outside the fp8 matmuls) with this backend, or None."""
    layout: Layout = Layout()
    """The mesh: dp_replicate x dp_shard x tp x cp x sp (hf_scale.config.parallelism); data parallel only unless a
    --hf_scale_config says otherwise."""
    cp_comm_strategy: str = "allgather"
    """How context-parallel ranks exchange keys/values (the config's parallelism.cp_comm_strategy; cp > 1 only)."""
    quantization: str | None = None
    """The base model's weights as loaded: "4bit" (--load_in_4bit, QLoRA's NF4 base) or None (unquantized). A
    checkpoint records it: its adapter continues only on the base it was trained on (reshard.check_resumable)."""
    final_save_is_checkpoint: bool = False
    """ZeRO-3 without 16-bit gathering on save: the run ends with the final step's checkpoint, not a safetensors
    model (hf_scale.train.checkpoint.final_checkpoint)."""

    def __post_init__(self):
        # Built from validated flags: a violation here is a bug in hf_scale, not bad input.
        assert self.world_size >= 1 and self.micro_batch_size >= 1 and self.gradient_accumulation_steps >= 1, self
        assert self.layout.model_parallel_size == 1 or self.layout.world_size == self.world_size, self
        assert self.global_batch_size == rules.global_batch_size(self.micro_batch_size,
                                                                 self.gradient_accumulation_steps,
                                                                 self.data_parallel_size)
        assert self.precision in rules.PRECISIONS, self.precision

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different data (the batch arithmetic, the loss's token count and the data position count
        these only): the world size divided by the ranks of one TP/CP/SP group, which share their batches."""
        return self.world_size // self.layout.model_parallel_size

    @property
    def expected(self) -> guard.Expected:
        """What the runtime guard proves before the first optimizer step."""
        return guard.Expected(
            strategy=self.strategy,
            world_size=self.world_size,
            micro_batch_size=self.micro_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            precision=rules.FP8 if self.fp8_backend else self.precision,  # accelerate's mixed_precision
            zero_stage=self.zero_stage,
            zero3_init=self.zero3_init,
            fsdp_version=self.fsdp_version,
            tp=self.layout.tp,
            ep=self.layout.ep,
            cp=self.layout.cp,
            sp=self.layout.sp,
        )

    @property
    def loss_scaling(self) -> bool:
        """fp16 scales the loss: an overflowing step is skipped, not a divergence."""
        return self.precision == "fp16"

    def describe(self) -> str:
        """The one line train.py logs at the start."""
        engine = f"deepspeed ZeRO-{self.zero_stage}" if self.strategy == "deepspeed" else self.strategy
        if self.layout.model_parallel_size > 1 or self.layout.ep > 1:
            engine += f" ({self.layout.describe()})"
        return (
            f"{engine} on {self.world_size} process(es) ({self.launcher}), {self.loop} loop: global batch size "
            f"{self.global_batch_size}, gradient accumulation steps {self.gradient_accumulation_steps}, local batch "
            f"size {self.micro_batch_size}; precision {self.precision}"
            + (f" with fp8 matmuls ({self.fp8_backend})" if self.fp8_backend else "")
            + (", packing" if self.packing else "")
        )


def build(request, args, *, loop: str, packing: bool, load_in_4bit: bool = False) -> RunSpec:
    """The run spec from the launch request and the final `TrainingArguments`: the batch arithmetic in this one
    block."""
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    global_batch = rules.global_batch_size(micro, accumulation,
                                           request.world_size // request.layout.model_parallel_size)
    plugin = getattr(args, "deepspeed_plugin", None)
    return RunSpec(
        launcher=request.launcher,
        strategy=request.strategy,
        world_size=request.world_size,
        loop=loop,
        micro_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        global_batch_size=global_batch,
        precision=rules.precision_from_flags(args.bf16, args.fp16),
        seed=args.seed,
        data_seed=args.data_seed if args.data_seed is not None else args.seed,
        packing=packing,
        zero_stage=request.zero_stage,
        zero3_init=request.zero_stage == 3 and bool(plugin) and bool(plugin.zero3_init_flag),
        fsdp_settings=request.fsdp_settings,
        fsdp_version=request.fsdp_version,
        fp8_backend=request.fp8_backend,
        layout=request.layout,
        cp_comm_strategy=request.cp_comm_strategy or "allgather",
        quantization="4bit" if load_in_4bit else None,
        # The config as DeepSpeed will run it ("auto" filled by accelerate's plugin).
        final_save_is_checkpoint=rules.zero3_without_gathering(plugin.deepspeed_config if plugin else None),
    )
