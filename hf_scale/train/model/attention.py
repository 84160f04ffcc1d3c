"""Which attention kernel a run uses (`--attn_implementation`, default ``auto``), and PyTorch's own
variable-length attention registered through transformers' attention interface.

With `--packing` a row holds many examples that must not attend to each other. In order of preference:

1. ``flash_attention_3`` / ``flash_attention_2`` (the flash-attn packages): a varlen kernel that computes
   only each example's own causal block, fed with the collator's ``cu_seq_lens``;
2. ``torch_varlen``: the same flash kernel shipped inside PyTorch (``torch.nn.attention.varlen``, CUDA,
   bf16/fp16), registered below as a transformers attention function — nothing extra to install;
3. ``flex_attention``: a compiled kernel with a block-sparse document mask (transformers builds it from
   the restarting ``position_ids``; it has no backward on CPU);
4. ``sdpa`` with a dense block-diagonal mask over the whole row (the cost grows with the row length
   squared): the last resort, with a warning.

Without packing, ``auto`` takes flash-attention when installed (it skips the padding) and else sdpa.
``auto`` names its choice and the reason in one log line; an explicit choice that cannot run here is a
one-line error before the model is loaded.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from functools import partial

import torch

from hf_scale.errors import UserError

TORCH_VARLEN = "torch_varlen"
CHOICES = ("auto", "flash_attention_3", "flash_attention_2", TORCH_VARLEN, "flex_attention", "sdpa", "eager")
VARLEN_KERNELS = frozenset({"flash_attention_3", "flash_attention_2", TORCH_VARLEN})
"""Implementations that take ``cu_seq_lens_q/k`` and ``max_length_q/k`` from the packed collator."""
DENSE_MASK_KERNELS = frozenset({"sdpa", "eager"})
"""Implementations that attend over a whole packed row through a dense mask (see the --packing warning)."""


@dataclass(frozen=True)
class AttentionEnvironment:
    """What decides which kernels can run: the device, the compute dtype, the installed packages."""

    cuda: bool
    half_precision: bool
    """q/k/v reach attention in bf16/fp16 (--bf16/--fp16 autocast, or bf16/fp16 weights)."""
    hopper: bool
    flash_attn_2: bool
    flash_attn_3: bool
    torch_varlen: bool
    flex_attention: bool


def observe_environment(*, half_precision: bool) -> AttentionEnvironment:
    from transformers.utils import (
        is_flash_attn_2_available,
        is_flash_attn_3_available,
        is_torch_flex_attn_available,
    )

    cuda = torch.cuda.is_available()
    return AttentionEnvironment(
        cuda=cuda,
        half_precision=half_precision,
        hopper=cuda and torch.cuda.get_device_capability()[0] == 9,
        flash_attn_2=is_flash_attn_2_available(),
        flash_attn_3=is_flash_attn_3_available(),
        torch_varlen=_torch_varlen_kernel() is not None,
        flex_attention=is_torch_flex_attn_available(),
    )


HALF = "bf16/fp16 (--bf16, --fp16 or --torch_dtype bfloat16)"


def _unmet(implementation: str, packing: bool, env: AttentionEnvironment) -> list[str]:
    """What `implementation` needs to train here and does not have (empty: it can run)."""
    needs = {
        "flash_attention_3": [
            (env.flash_attn_3, "the flash_attn_interface package (FlashAttention-3)"),
            (env.cuda and env.hopper, "a Hopper GPU"),
            (env.half_precision, HALF),
        ],
        "flash_attention_2": [
            (env.flash_attn_2, "the flash_attn package"),
            (env.cuda, "a CUDA GPU"),
            (env.half_precision, HALF),
        ],
        TORCH_VARLEN: [
            (env.torch_varlen, "torch.nn.attention.varlen (PyTorch >= 2.9)"),
            (env.cuda, "a CUDA GPU"),
            (env.half_precision, HALF),
            (packing, "--packing (it attends within each packed example)"),
        ],
        "flex_attention": [
            (env.flex_attention, "torch.nn.attention.flex_attention"),
            (env.cuda, "a CUDA GPU (no backward pass on CPU)"),
        ],
    }.get(implementation, [])
    return [what for ok, what in needs if not ok]


def choose(requested: str, *, packing: bool, env: AttentionEnvironment) -> tuple[str, str]:
    """(implementation, why): the best kernel for ``auto``, or the requested one if it can run here."""
    if requested not in CHOICES:
        raise UserError(f"--attn_implementation {requested}: unknown; allowed: {', '.join(CHOICES)}")
    if requested != "auto":
        missing = _unmet(requested, packing, env)
        if missing:
            raise UserError(
                f"--attn_implementation {requested}: needs {', '.join(missing)}; use auto, sdpa or eager"
            )
        return requested, "requested"
    preference = ["flash_attention_3", "flash_attention_2"]
    if packing:
        preference += [TORCH_VARLEN, "flex_attention"]
    for candidate in preference:
        if not _unmet(candidate, packing, env):
            return candidate, "auto: the best that runs here" + (" for packed rows" if packing else "")
    # The first thing each faster kernel lacks is enough to say why it was not taken.
    skipped = ", ".join(f"{name} needs {_unmet(name, packing, env)[0].split(' (')[0]}" for name in preference)
    return "sdpa", f"auto: {skipped}"


# ------------------------------------------------------------------------------------- torch_varlen
def _torch_varlen_kernel():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@dataclass(frozen=True)
class VarlenKernel:
    """A varlen_attn-like function and how to call it, read once from its signature (outside any
    torch.compile'd code, where inspecting it would break the graph at every layer)."""

    function: object
    causal: dict
    """torch 2.9-2.10 take is_causal=True; later versions say causal as window_size=(-1, 0)."""
    grouped_query: bool
    """It takes fewer key/value heads than query heads (enable_gqa); else they are repeated."""

    @classmethod
    def of(cls, function) -> VarlenKernel:
        parameters = inspect.signature(function).parameters
        causal = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
        return cls(function, causal, "enable_gqa" in parameters)


def torch_varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    position_ids: torch.Tensor | None = None,
    *,
    kernel: VarlenKernel,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function (``AttentionInterface``) on ``torch.nn.attention.varlen``.

    q/k/v arrive as ``[batch, heads, length, head_dim]``; the packed micro-batch is flattened to
    ``[batch * length, heads, head_dim]`` and every example (``cu_seq_lens_q``, from the collator, or
    else from the restarting ``position_ids``) gets causal attention within itself only.
    """
    if dropout:
        raise ValueError(f"{TORCH_VARLEN} attention has no dropout (the model asks for {dropout})")
    if cu_seq_lens_q is None:
        if position_ids is None:
            raise ValueError(f"{TORCH_VARLEN} attention needs packed position_ids or cu_seq_lens_q")
        from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

        (cu_seq_lens_q, _), (max_length, _) = prepare_fa_kwargs_from_position_ids(position_ids)
        max_length_q = int(max_length)
    batch, heads, length, head_dim = query.shape
    dtype = query.dtype
    if dtype == torch.float32 and torch.is_autocast_enabled(query.device.type):
        # Rotary embeddings hand fp32 queries to attention under autocast; the kernel wants bf16/fp16.
        dtype = torch.get_autocast_dtype(query.device.type)
    q, k, v = (x.transpose(1, 2).reshape(batch * length, x.shape[1], head_dim).to(dtype) for x in (query, key, value))
    extra = dict(kernel.causal)
    if k.shape[1] != heads:  # grouped-query attention
        if kernel.grouped_query:
            extra["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (k, v))
    cu_seq_lens_q = cu_seq_lens_q.to(device=q.device, dtype=torch.int32)
    out = kernel.function(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, scale=scaling, **extra)
    return out.view(batch, length, heads, head_dim), None


def register_torch_varlen(function=None) -> None:
    """Make ``attn_implementation="torch_varlen"`` known to transformers (idempotent).

    No mask function is registered: transformers then builds no attention mask at all, and the kernel
    separates the examples itself. `function` replaces PyTorch's varlen_attn (a reference in tests).
    """
    from transformers import AttentionInterface

    kernel = VarlenKernel.of(function or _torch_varlen_kernel())
    AttentionInterface.register(TORCH_VARLEN, partial(torch_varlen_attention_forward, kernel=kernel))


def compiles(implementation: str, args) -> bool:
    """Whether the forward pass is compiled (--torch_compile, or flex_attention's own torch.compile), so that
    packed rows must all have one shape: each new length would compile again."""
    return bool(args.torch_compile) or implementation == "flex_attention"


def resolve(requested: str, *, packing: bool, half_precision: bool, announce: bool, required: str | None = None) -> str:
    """The implementation this run uses; registers ``torch_varlen`` when chosen and says which in one line.
    ``required``: the kernel the run's parallelism wraps (``auto`` takes it; another choice was refused before)."""
    if required is not None and requested in ("auto", required):
        implementation, why = required, "the run's context/sequence parallelism wraps it"
    else:
        implementation, why = choose(requested, packing=packing, env=observe_environment(half_precision=half_precision))
    if implementation == TORCH_VARLEN:
        register_torch_varlen()
    if announce:
        print(f"hf_scale: attention: {implementation} ({why})", file=sys.stderr, flush=True)
        if packing and implementation in DENSE_MASK_KERNELS:
            # Correct either way (packed examples never attend to each other), but the dense mask computes
            # attention over the whole packed row.
            print(f"hf_scale: warning: --packing with attn_implementation={implementation} masks attention over "
                  "the whole packed row (cost grows with the row length squared); on a GPU with --bf16, "
                  f"{TORCH_VARLEN} (PyTorch >= 2.9) or flash-attn computes each example's block only",
                  file=sys.stderr, flush=True)
    return implementation
