"""Checks of FP8 training: the YAML's `fp8_config` keys and values as accelerate reads them
(hf_scale.knowledge.library_tables asks accelerate), the combinations accelerate refuses at start, in a hand-written
accelerate YAML (the rule the config applies when generating, hf_scale.knowledge.precision_rules.fp8_refusal), and where
fp8 will run slower than bf16. (A machine without an fp8 GPU is train.py's refusal before the model loads, and `doctor
--config`'s.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from hf_scale.check.findings import (
    ERROR,
    TRAINING_ARGS,
    WARNING,
    Finding,
    Source,
    ignored_key_severity,
    in_file,
    is_comment_key,
    rename_fix,
)
from hf_scale.check.inputs import CheckInputs, deepspeed_view, local_model_config
from hf_scale.files.reading import get_path
from hf_scale.knowledge import precision_rules, rules
from hf_scale.knowledge.library_tables import fp8_launch_name, fp8_value_problem, known_fp8_names

SECTION = "fp8_config"

RAM_EFFICIENT_LOADING_KEY = "fsdp_config.fsdp_cpu_ram_efficient_loading"
ACCELERATE_RAM_EFFICIENT_LOADING = "FSDP_CPU_RAM_EFFICIENT_LOADING"
"""What accelerate launch exports for it (default true when the YAML leaves it out: its launch parser's default)."""


def fp8_source(inp: CheckInputs) -> tuple[str, str, str] | None:
    """(file, key, backend) of whatever asks for fp8: the accelerate YAML or the --hf_scale_config."""
    if inp.accelerate.get("mixed_precision") == "fp8":
        return inp.accelerate_file, "mixed_precision", rules.fp8_backend_of_yaml(inp.accelerate)
    cfg = inp.hf_scale_config
    if cfg is not None and cfg.precision == "fp8":
        return inp.hf_scale_config_file or "", "precision", cfg.fp8.backend
    return None


def _ram_efficient_loading(inp: CheckInputs) -> bool:
    """Whether accelerate launch loads the FSDP model on rank 0 only, as its launch code exports it for this YAML."""
    if inp.launch_env is not None and ACCELERATE_RAM_EFFICIENT_LOADING in inp.launch_env:
        return inp.launch_env[ACCELERATE_RAM_EFFICIENT_LOADING] == "true"
    return str(get_path(inp.accelerate, RAM_EFFICIENT_LOADING_KEY, True)).lower() == "true"


def check_fp8_config(inp: CheckInputs) -> Iterator[Finding]:
    """`fp8-key-unknown`, `fp8-value-invalid`: a key under `fp8_config` that accelerate never reads
    (`accelerate launch` exports it and nothing reads it: an error when it misspells one, e.g. `amax_history_length`,
    which `accelerate config` itself writes), and, with `mixed_precision: fp8`, a value accelerate refuses when the
    processes start (its FP8BackendType, its recipe kwargs: `backend: AOO`, `fp8_format: E5M2X`, `opt_level: O9`) or a
    length below 1 (`amax_history_len`)."""
    block = inp.accelerate.get(SECTION)
    if not isinstance(block, dict):
        return  # not a mapping: `accelerate-value-invalid`
    known = known_fp8_names()
    fp8 = inp.accelerate.get("mixed_precision") == "fp8"
    for key, value in block.items():
        name = fp8_launch_name(str(key))
        where = {f"{inp.accelerate_file}:{SECTION}.{key}": value}
        if name not in known:
            if is_comment_key(key):
                continue
            # Suggest the YAML spelling: the launch name without the fp8_ accelerate adds (unless the key had it).
            spelled = {option if str(key).startswith("fp8") else option.removeprefix("fp8_") for option in known}
            yield Finding(ignored_key_severity(str(key), spelled), "fp8-key-unknown", inp.accelerate_file,
                          f"{SECTION}.{key}",
                          "Not an fp8 setting accelerate reads: `accelerate launch` exports it and nothing reads it "
                          "(the recipe keeps its default).",
                          rename_fix(str(key), spelled, f"`{SECTION}` key", inp.accelerate_file), where)
            continue
        problem = fp8_value_problem(name, value) if fp8 else None
        if problem:
            yield Finding(ERROR, "fp8-value-invalid", inp.accelerate_file, f"{SECTION}.{key}",
                          f"`{SECTION}.{key}`={value!r} {problem}.",
                          f"{in_file(inp.accelerate_file)}set `{SECTION}.{key}` to a value accelerate allows, or "
                          "remove it for accelerate's default (`hf-scale generate` writes valid fp8 blocks).", where)


def check_fp8_refused(inp: CheckInputs) -> Iterator[Finding]:
    """`fp8-refused`: an accelerate YAML asks for an fp8 combination accelerate refuses at start (torchao with FSDP
    and rank-0-only loading, `fsdp_cpu_ram_efficient_loading`, which accelerate launch turns on when the YAML leaves
    it out; MS-AMP with FSDP or DeepSpeed): the rule `hf-scale generate` applies to the config."""
    source = fp8_source(inp)
    strategy = rules.STRATEGY_OF_DISTRIBUTED_TYPE.get(str(inp.accelerate.get("distributed_type")))
    if source is None or not inp.accelerate_file or strategy is None:
        return
    file, key, backend = source
    ram_loading = strategy == "fsdp" and _ram_efficient_loading(inp)
    refusal = precision_rules.fp8_refusal(backend, strategy, cpu_ram_efficient_loading=ram_loading)
    if refusal is None:
        return
    yaml = Path(inp.accelerate_file).name
    asked = {f"{file}:{key}": "fp8", f"{inp.accelerate_file}:distributed_type": inp.accelerate["distributed_type"]}
    if refusal.change == precision_rules.RAM_EFFICIENT_LOADING:
        yield Finding(ERROR, "fp8-refused", inp.accelerate_file, RAM_EFFICIENT_LOADING_KEY,
                      f"fp8 with backend torchao (AO) under FSDP with {RAM_EFFICIENT_LOADING_KEY}=true (accelerate "
                      f"launch's default): {refusal.reason}; the run stops at start.",
                      f"Set `fsdp_cpu_ram_efficient_loading: false` under fsdp_config in {yaml}, or set "
                      f"`{key}` to bf16 in {Path(file).name}.",
                      {**asked, f"{inp.accelerate_file}:{RAM_EFFICIENT_LOADING_KEY}": True})
        return
    where = (file, "fp8_config.backend") if key == "mixed_precision" else (file, "fp8.backend")
    yield Finding(ERROR, "fp8-refused", *where,
                  f"fp8 with backend {backend} under distributed_type={inp.accelerate['distributed_type']} in "
                  f"{yaml}: {refusal.reason}; the run stops at start.",
                  f"Set `backend` ({where[1]}) to {'AO or TE' if key == 'mixed_precision' else 'torchao or te'} in "
                  f"{Path(file).name}, or train with distributed_type MULTI_GPU.",
                  {**asked, ":".join(where): backend})


def _offloaded(inp: CheckInputs) -> Source | None:
    """Where the run offloads (DeepSpeed's offload devices, FSDP's offload_params), if it does."""
    view = deepspeed_view(inp)
    for block in ("offload_optimizer", "offload_param"):
        path = f"zero_optimization.{block}.device"
        device = get_path(view.config, path, "none") if view else "none"
        if device not in ("none", None):
            return Source(*view.where(path), device)
    if str(get_path(inp.accelerate, "fsdp_config.fsdp_offload_params", False)).lower() == "true":
        return Source(inp.accelerate_file, "fsdp_config.fsdp_offload_params", True)
    return None


def check_fp8_speed(inp: CheckInputs) -> Iterator[Finding]:
    """`fp8-no-compile`, `fp8-offload`, `fp8-small-layers`: fp8 asked for where it is usually slower than
    bf16: torchao without --torch_compile (the scaling casts then run as separate kernels), with offload (host transfers
    dominate), or on a model whose linear layers are all below the backend's size threshold (nothing is converted)."""
    source = fp8_source(inp)
    if source is None:
        return
    file, key, backend = source
    asked = Source(file, key, "fp8")
    use_bf16 = f"set `{key}` to bf16 in {Path(file).name}"
    # The advice is torchao's (its speedups are measured compiled); TransformerEngine's fused kernels need no compile.
    if backend == "torchao" and inp.training is not None and not inp.training.get("torch_compile"):
        yield Finding(WARNING, "fp8-no-compile", TRAINING_ARGS, "--torch_compile",
                      f"{asked.label}='fp8' without --torch_compile: the casts and scalings run as separate kernels "
                      "and the step is usually slower than bf16 (torchao's speedups are measured compiled).",
                      f"Add --torch_compile to the training args, or {use_bf16}.",
                      {f"{TRAINING_ARGS}:--torch_compile": False, asked.where: "fp8"})
    offload = _offloaded(inp)
    if offload:
        yield Finding(WARNING, "fp8-offload", offload.file, offload.key,
                      f"{asked.label}='fp8' with {offload.label}={offload.value!r}: the host transfers dominate the "
                      "step, so the faster matmuls rarely show.",
                      f"Drop the offload (`{offload.key}` in {Path(offload.file).name}), or {use_bf16}.",
                      {offload.where: offload.value, asked.where: "fp8"})
    plan = _model_plan(inp, backend)
    if plan is not None and not plan.converted:
        yield Finding(WARNING, "fp8-small-layers", file, key,
                      f"{asked.label}='fp8' but no linear layer of this model is large enough for fp8 "
                      f"({len(plan.kept)} stay in bf16): the run pays fp8's casts and gains nothing.",
                      f"{use_bf16[0].upper()}{use_bf16[1:]} for this model (fp8 pays off from ~8B parameters).",
                      {asked.where: "fp8"})


def _model_plan(inp: CheckInputs, backend: str):
    """Which layers would be converted, for a model whose config is readable here (a local directory or the embedded
    demo model; a Hub id is not fetched): built on the meta device, nothing allocated. None when unknown."""
    if inp.training is None or backend != "torchao":
        return None
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return None
    config = local_model_config(inp)
    if config is None:
        return None
    import torch
    from transformers import AutoModelForCausalLM

    from hf_scale.knowledge import fp8_layers

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError):
        return None  # not a causal LM transformers can build: the training would say so
    return fp8_layers.plan(model, backend)
