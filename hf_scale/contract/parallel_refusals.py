"""What train.py refuses of a parallel layout (tp, cp, sp, ep) before anything is built, in its own words: flags the
layout cannot run with (:func:`flag_refusal`) and models it cannot split (:func:`model_problem`). One rule for every
reader: train.py's start (hf_scale.train.setup.reconcile, hf_scale.train.main), `hf-scale check`
(hf_scale.check.parallelism) and `hf-scale generate`'s cluster arguments (hf_scale.commands.generate)."""

from __future__ import annotations

from hf_scale.config import expert_parallel
from hf_scale.config.parallelism import CP_ATTENTION, Layout, head_problem


def cp_flag_refusal(layout: Layout, *, packing: bool, attn_implementation: str, where: str) -> str | None:
    """Why train.py's flags cannot run with context parallelism, or None (checked before the process group)."""
    if layout.cp <= 1:
        return None
    cp = f"{where}.cp={layout.cp}"
    if packing:
        return (f"{cp} with --packing: ring attention takes no document mask, so packed examples would attend to each "
                "other; drop --packing or set cp to 1")
    if attn_implementation not in ("auto", *CP_ATTENTION):
        return (f"{cp} with --attn_implementation {attn_implementation}: context parallelism shards only SDPA "
                f"attention; use --attn_implementation {' or '.join(CP_ATTENTION)} (or auto)")
    return None


def cp_model_refusal(layout: Layout, model_config, where: str) -> str | None:
    """Why this model cannot run with context parallelism, or None (checked before the model loads): attention
    stricter than causal (sliding-window, chunked), which accelerate's hooks would silently train as full causal
    attention (accelerate refuses it too, after the model is built)."""
    if layout.cp <= 1:
        return None
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        strict = sorted({kind for kind in layer_types if kind != "full_attention"})
    else:
        strict = ["sliding_attention"] if getattr(config, "sliding_window", None) else []
    if strict:
        return (f"{where}.cp={layout.cp}: the model has {', '.join(strict)} layers; context parallelism computes full "
                "causal attention only; set cp to 1")
    return None


def flag_refusal(layout: Layout, *, packing: bool, attn_implementation: str, lora_r: int, where: str) -> str | None:
    """Why train.py's flags cannot run with the layout, or None. One rule for both readers: train.py applies it
    before the process group (hf_scale.train.setup.reconcile), `hf-scale check` to the flags it is given
    (hf_scale.check.parallelism); ``where`` names the layout's key (``.cp=2`` etc. follow)."""
    refusal = cp_flag_refusal(layout, packing=packing, attn_implementation=attn_implementation,
                                            where=where)
    if refusal:
        return refusal
    sp = f"{where}.sp={layout.sp}"
    if layout.sp > 1 and packing:
        return (f"{sp} with --packing: packed sequences under sequence parallelism are not proven here; drop "
                "--packing or set sp to 1")
    if layout.sp > 1 and attn_implementation not in ("auto", "sdpa"):
        # `auto` resolves to sdpa under sp (hf_scale.train.model.attention.resolve's `required`).
        return (f"{sp} with --attn_implementation={attn_implementation}: Ulysses runs here around sdpa; use "
                "--attn_implementation sdpa (or auto)")
    if layout.ep > 1 and lora_r > 0:
        return (f"--lora_r={lora_r} with expert parallelism ({where}.ep={layout.ep}): hf_scale has not proven peft's "
                "LoRA layers on expert-parallel weights; train all weights (--lora_r 0) or set parallelism.ep to 1")
    if layout.tp > 1 and lora_r > 0:
        return (f"--lora_r={lora_r} with tensor parallelism ({where}.tp={layout.tp}): hf_scale has not proven peft's "
                "LoRA layers on DTensor weights; train all weights (--lora_r 0) or set parallelism.tp to 1")
    return None


def model_problem(layout: Layout, model_config, where: str) -> str | None:
    """What the model's config rules out for the layout, or None: experts that ep cannot split (a dense model, no
    expert-parallel plan in transformers, experts ep does not divide: expert_parallel.model_problem), a router
    auxiliary loss under sequence parallelism (whose loss path would leave it out), heads that tp
    or sp cannot split whole (parallelism.head_problem), attention that context parallelism cannot compute
    (cp_model_refusal). train.py asks before the model loads: in prepare when config.json is local,
    else once it has been read."""
    problem = expert_parallel.model_problem(layout.ep, model_config, where)
    if problem:
        return problem

    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    if layout.sp > 1 and getattr(config, "output_router_logits", False):
        # Both loops' sp path computes the token loss from the shards itself (sequence_parallel.shard_loss): the
        # router's auxiliary loss would be left out of the gradient without a word.
        return (f"{where}.sp={layout.sp} with a model whose router adds an auxiliary loss (output_router_logits: "
                "true in its config): sequence parallelism would train without that loss; use sp=1 or set "
                "output_router_logits to false")
    heads = getattr(config, "num_attention_heads", None)
    if heads and (layout.tp > 1 or layout.sp > 1):
        problem = head_problem(layout, heads, getattr(config, "num_key_value_heads", None) or heads, where=where)
        if problem:
            return problem
    return cp_model_refusal(layout, model_config, where)
