"""Expert parallelism (``parallelism.ep``): the rules a mixture-of-experts layout must obey before launch.

hf_scale's EP is transformers' (5.24): ``from_pretrained(distributed_config=DistributedConfig(ep_size, fsdp_size,
tp_size))`` puts each rank's share of the routed experts on it (the model's ``base_model_ep_plan``: experts sharded on
their first dimension, tokens exchanged by all-to-all) and FSDP2 over the dense part. EP is no extra mesh dimension:
the ``ep`` ranks of one group are carved out of ``dp_shard x tp`` (transformers' ``efsdp = fsdp x tp / ep`` ranks hold
the same experts and FSDP-shard them), so the world size and the data-parallel size are unchanged and every EP rank
sees its own batch.

What transformers checks itself (``DistributedConfig._validate_mesh_config``: ep a multiple of tp, dividing fsdp x tp;
``GroupedGemmParallel``: experts divisible by ep) it checks only inside the started processes, one traceback per
rank; what it leaves to the user (EP within a machine, a model without an EP plan, which strategy can hold its
DTensors) it never checks. Both are said here in one line each, before launch, by the config, `hf-scale check` and
train.py alike.
"""

from __future__ import annotations

from typing import Any

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""The config keys transformers' MoE models name their routed experts by: Qwen-MoE/OLMoE, Mixtral/gpt-oss,
DeepSeek/GLM-MoE."""
ACTIVE_EXPERT_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk")
"""Routed experts each token runs through (Qwen/Mixtral/DeepSeek, gpt-oss, Hunyuan)."""
SHARED_EXPERT_KEYS = ("n_shared_experts", "num_shared_experts")
"""Experts every token runs through besides the routed ones (DeepSeek/GLM, Qwen2-MoE's shared expert)."""

DEEPSPEED_REASON = (
    "ZeRO partitions every parameter over its own data-parallel groups and cannot hold the expert-parallel DTensors "
    "transformers builds, and DeepSpeed's own expert parallelism (the DeepSpeed JSON's expert_parallel/AutoEP "
    "section) replaces the model's MoE layers with its own, which hf_scale has not proven; use strategy fsdp with "
    "fsdp.version=2 (FSDP2 + EP)"
)


def layout_problems(layout, *, strategy: str, fsdp_version: int | None, processes_per_machine: int,
                    ep_across_machines: bool = False, where: str = "parallelism") -> tuple[list[str], list[str]]:
    """(refusals, warnings) of the layout's ep, one line each (none when ep is 1): which strategies compose with it
    (FSDP2 only), transformers' mesh rules (ep a multiple of tp dividing dp_shard x tp), cp beside it, and an EP group
    that leaves its machine (refused unless ``ep_across_machines``, then a warning)."""
    ep, tp = layout.ep, layout.tp
    if ep <= 1:
        return [], []
    name = f"{where}.ep={ep}"
    if strategy == "deepspeed":
        return [f"{name} with strategy deepspeed: {DEEPSPEED_REASON}"], []
    if not (strategy == "fsdp" and fsdp_version == 2):
        got = f"strategy={strategy}" + (f", fsdp.version={fsdp_version}" if strategy == "fsdp" else "")
        return [f"{name} needs strategy fsdp with fsdp.version=2 (got {got}): transformers shards the experts over ep "
                "and the dense part with FSDP2 (its DistributedConfig(ep_size, fsdp_size)); DDP and FSDP1 cannot "
                "hold its DTensors"], []
    errors: list[str] = []
    sharded = layout.dp_shard * tp
    if ep % tp or sharded % ep:
        errors.append(f"{name} must be a multiple of {where}.tp={tp} that divides dp_shard x tp = {layout.dp_shard} x "
                      f"{tp} = {sharded} (transformers' DistributedConfig: the ep ranks are carved out of the "
                      f"FSDP x TP ranks); allowed ep: {', '.join(map(str, allowed_sizes(layout)))}")
    if layout.cp > 1:
        errors.append(f"{name} with {where}.cp={layout.cp}: hf_scale's EP mesh is transformers', which context "
                      "parallelism does not use; set one of them to 1")
    warnings: list[str] = []
    if processes_per_machine % ep:
        spans = (f"{name} does not fit inside one machine of {processes_per_machine} processes (ep must divide "
                 f"topology.processes_per_machine={processes_per_machine})")
        if ep_across_machines:
            warnings.append(f"{spans}: every MoE layer's two all-to-alls cross the machines' link "
                            f"({where}.ep_across_machines=true)")
        else:
            errors.append(f"{spans}: every MoE layer exchanges its tokens by all-to-all twice, too slow across "
                          f"machines; allowed: a divisor of {processes_per_machine}, or set "
                          f"{where}.ep_across_machines=true to accept it")
    return errors, warnings


def allowed_sizes(layout) -> list[int]:
    """The ep sizes transformers accepts for the layout's dp_shard and tp (multiples of tp dividing dp_shard x tp),
    1 (no EP) first."""
    sharded = layout.dp_shard * layout.tp
    return [1] + [ep for ep in range(layout.tp, sharded + 1, layout.tp) if ep > 1 and sharded % ep == 0]


def expert_counts(config: Any) -> tuple[int | None, int | None, int]:
    """(routed experts per MoE layer, active routed experts per token, shared experts) of a model config (its text
    config for a multimodal one); (None, None, 0) for a dense model."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config

    def first(keys: tuple[str, ...]) -> int | None:
        return next((value for key in keys if isinstance(value := getattr(text, key, None), int) and value > 0), None)

    routed = first(EXPERT_COUNT_KEYS)
    if routed is None or routed <= 1:
        return None, None, 0
    return routed, first(ACTIVE_EXPERT_KEYS), first(SHARED_EXPERT_KEYS) or 0


def model_problem(ep: int, config: Any, where: str = "parallelism") -> str | None:
    """Why the model cannot be split over ``ep`` ranks, or None (:func:`experts_problem` of its config)."""
    if ep <= 1:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kind = getattr(text, "model_type", None) or type(text).__name__
    return experts_problem(ep, kind, expert_counts(config)[0], bool(getattr(text, "base_model_ep_plan", None)), where)


def experts_problem(ep: int, kind: str, routed: int | None, has_ep_plan: bool,
                    where: str = "parallelism") -> str | None:
    """Why a model of type ``kind`` with ``routed`` experts per layer cannot be split over ``ep`` ranks, or None: a
    dense model, a model transformers has no expert-parallel plan for (``base_model_ep_plan`` missing from its config
    class: Llama 4 in 5.24, whose experts take tokens pre-scaled by the router), or routed experts that ``ep`` does not
    divide (each rank holds whole experts)."""
    if ep <= 1:
        return None
    if routed is None:
        return (f"{where}.ep={ep} needs a mixture-of-experts model; {kind} is dense (no "
                f"{'/'.join(EXPERT_COUNT_KEYS)} in its config): set ep to 1")
    if not has_ep_plan:
        return (f"{where}.ep={ep}: transformers has no expert-parallel plan for {kind} (base_model_ep_plan is missing "
                "from its config class), so from_pretrained cannot shard its experts; set ep to 1 (its experts are "
                "then sharded by FSDP like the rest)")
    if routed % ep:
        divisors = [d for d in range(1, routed + 1) if routed % d == 0]
        return (f"{where}.ep={ep} does not divide the model's {routed} routed experts: each rank holds whole experts; "
                f"allowed ep: {', '.join(map(str, divisors))}")
    return None
