"""Loading the model and tokenizer, and LoRA. (The final Hugging Face save is `save.py`'s.)

The model is always created with `AutoModelForCausalLM.from_pretrained`. Under ZeRO-3 the caller has
already built `TrainingArguments(deepspeed=...)`, whose `HfTrainerDeepSpeedConfig` registers itself
globally; `from_pretrained` sees it and builds the model inside `deepspeed.zero.Init`, so no process
materialises the full weights.
"""

from __future__ import annotations

import math
import os
import pickle
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from hf_scale import quiet
from hf_scale.contract.model_arguments import ModelArguments
from hf_scale.errors import UserError
from hf_scale.files.reading import not_a_regular_file
from hf_scale.knowledge import rules


def load_dtype(spelling: str):
    """`--torch_dtype` (either spelling, see hf_scale.knowledge.rules) as transformers' `dtype`: a torch.dtype or
    "auto"."""
    name = rules.torch_dtype_name(spelling, "--torch_dtype")
    return name if name == rules.AUTO_DTYPE else getattr(torch, name)


def resolve_model_path(model_args: ModelArguments) -> str:
    from hf_scale.contract.embedded_assets import EMBEDDED_MODEL_DIR

    return model_args.model_name_or_path or str(EMBEDDED_MODEL_DIR)


def load_pretrained_config(model_path: str, trust_remote_code: bool):
    """The model's config; one line for a config.json that is missing, unreadable, or holds values the model
    cannot be built from (the planner's rule, hf_scale.knowledge.model_shapes, then transformers' own checks)."""
    from hf_scale.knowledge.model_shapes import CONFIG_ERRORS, check_dimensions

    where = f"--model_name_or_path={model_path}"
    values = _config_values(model_path, where)
    check_dimensions(values, where)  # a Hub model's too
    _check_known_names(values, where)
    try:
        return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (*CONFIG_ERRORS, OSError) as error:  # typed config fields, then the architecture's own checks
        detail = " ".join(str(error).split())[:200]
        raise UserError(f"{where}: transformers cannot build a model from its config.json ({detail})") from None


def _check_known_names(values: dict, where: str) -> None:
    """config.json's model_type and activation name things transformers knows (a model shipping its own code,
    `auto_map`, may name others): one line naming the value and what is allowed, instead of transformers'
    paragraph (model_type) or a bare KeyError from inside the architecture's constructor (hidden_act)."""
    if "auto_map" in values:
        return
    from transformers import __version__
    from transformers.activations import ACT2FN
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = values.get("model_type")
    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING:
        known = sorted(CONFIG_MAPPING.keys())
        examples = ", ".join(t for t in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma2") if t in known)
        raise UserError(f"{where}: config.json: model_type={model_type!r} is not an architecture transformers "
                        f"{__version__} knows; allowed: one of its {len(known)} model types (e.g. {examples}), or a "
                        "model that ships its code (auto_map) with --trust_remote_code true")
    for key in ("hidden_act", "hidden_activation"):
        value = values.get(key)
        if isinstance(value, str) and value not in ACT2FN:
            raise UserError(f"{where}: config.json: {key}={value!r} is not an activation transformers knows; "
                            f"allowed: {', '.join(sorted(ACT2FN))}")


def _config_values(model_path: str, where: str) -> dict:
    """config.json as a dict: a local one read strictly and checked (hf_scale.knowledge.model_shapes.read_config_json),
    a Hub model's through transformers."""
    path = Path(model_path)
    if path.exists() and not path.is_dir():
        kind = (not_a_regular_file(path) or "is a file").split(",")[0]
        raise UserError(f"{where}: {kind}; expected a model directory (with config.json) or a Hub id")
    if path.is_dir() and not os.path.lexists(path / "config.json"):
        raise UserError(f"{where}: local directory without a valid config.json (it has none); pass a local model "
                        "directory or a reachable Hub id")
    if path.is_dir():
        from hf_scale.knowledge.model_shapes import read_config_json

        return read_config_json(path / "config.json", where)
    try:
        values = PretrainedConfig.get_config_dict(model_path)[0]
    except (OSError, ValueError) as error:
        looks_local = path.exists() or model_path.startswith((".", "/", "~"))
        what = "local directory without a valid config.json" if looks_local else "Hub id that could not be loaded"
        raise UserError(f"{where}: {what} ({str(error).splitlines()[0][:160]}); pass a local model directory "
                        "or a reachable Hub id") from None
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise UserError(f'{where}: config.json has no "model_type" (expected a transformers config.json object)')
    return values


def load_tokenizer(model_args: ModelArguments) -> PreTrainedTokenizerBase:
    name = model_args.tokenizer_name_or_path or resolve_model_path(model_args)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=model_args.trust_remote_code)
    except (OSError, ValueError) as error:
        raise UserError(
            f"--tokenizer_name_or_path={name}: no tokenizer could be loaded ({str(error).splitlines()[0][:160]})"
        ) from None
    if tokenizer.pad_token is None:
        # Llama-family tokenizers ship without a pad token; padding positions are masked out of the loss.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_lora_flags(model_args) -> None:
    """Each LoRA flag in its range, named by itself (before anything is loaded)."""
    if model_args.lora_r < 0:
        raise UserError(f"--lora_r={model_args.lora_r}: must be >= 0 (0 trains all weights, > 0 is the LoRA rank)")
    if model_args.lora_r == 0:
        return
    if model_args.lora_alpha <= 0:
        raise UserError(f"--lora_alpha={model_args.lora_alpha}: must be > 0 (the LoRA scaling is alpha / r)")
    if not (math.isfinite(model_args.lora_dropout) and 0 <= model_args.lora_dropout < 1):
        raise UserError(f"--lora_dropout={model_args.lora_dropout}: must be in [0, 1)")
    if not model_args.lora_target_modules.strip(" ,"):
        raise UserError("--lora_target_modules is empty: name modules (comma-separated) or use all-linear")


_WEIGHT_READERS = ("torch/serialization.py", "torch/_weights_only_unpickler.py", "/pickle.py", "/safetensors/")
"""Where reading a weights file happens: garbage bytes raise whatever the unpickler trips on there (IndexError,
KeyError...), which must not be taken for the architecture failing on config.json."""


def _raised_reading_weights(error: BaseException) -> bool:
    frame = error.__traceback__
    while frame is not None:
        if any(part in frame.tb_frame.f_code.co_filename.replace("\\", "/") for part in _WEIGHT_READERS):
            return True
        frame = frame.tb_next
    return False


def _weights_error(error: BaseException) -> str | None:
    """`error` from from_pretrained described in one line when the weight files are the problem, else None."""
    import torch

    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return None
    unreadable = isinstance(error, (OSError, EOFError, ValueError, pickle.UnpicklingError)) or (
        type(error).__name__ == "SafetensorError") or _raised_reading_weights(error)
    # transformers raises RuntimeError for shapes that do not fit the config; torch for a broken zip (.bin).
    mismatch = isinstance(error, RuntimeError) and any(
        k in str(error) for k in ("ignore_mismatched_sizes", "size mismatch", "PytorchStreamReader"))
    if not (unreadable or mismatch):
        return None
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"


_BUILD_ERRORS = (KeyError, TypeError, AttributeError, IndexError, ZeroDivisionError, AssertionError, ValueError)
"""What an architecture's constructor raises on config values it cannot use (RuntimeError is left out: out of
memory, DeepSpeed's partitioning)."""


def _from_pretrained(path: str, model_args: ModelArguments, load_kwargs: dict):
    """The model, or one line: weights that cannot be read, that lack tensors of the model, or whose shapes are
    not the config's (asked for with ignore_mismatched_sizes, so that they are named here, not in a table)."""
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=load_dtype(model_args.torch_dtype),
            attn_implementation=model_args.attn_implementation,
            trust_remote_code=model_args.trust_remote_code,
            output_loading_info=True,
            ignore_mismatched_sizes=True,
            **load_kwargs,
        )
    except Exception as error:
        described = _weights_error(error)
        if described is not None:
            raise UserError(f"--model_name_or_path={path}: the weights cannot be loaded ({described})") from None
        if not isinstance(error, _BUILD_ERRORS):
            raise
        # The architecture's code ran on config.json's values (e.g. an unknown hidden_act).
        detail = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
        raise UserError(f"--model_name_or_path={path}: transformers cannot build the model from its config.json "
                        f"({detail})") from None
    if info.get("mismatched_keys"):
        name, in_weights, in_model = sorted(info["mismatched_keys"])[0]
        raise UserError(f"--model_name_or_path={path}: config.json does not match the weights: "
                        f"{len(info['mismatched_keys'])} tensors have other shapes (first: {name} is "
                        f"{list(in_weights)} in the weights, {list(in_model)} by config.json); use the config.json "
                        "the weights were saved with")
    if info.get("missing_keys"):
        # transformers would initialise them randomly and train a model that is not the one asked for.
        missing = sorted(info["missing_keys"])
        raise UserError(f"--model_name_or_path={path}: the weights lack {len(missing)} tensors of the model "
                        f"(first: {missing[0]}); they would be trained from random values")
    return model


def load_model(model_args: ModelArguments, *, gradient_checkpointing: bool, on_mesh: dict | None = None,
               sharded_precision: str | None = None):
    """The caller has already validated the path with load_pretrained_config (one-line error, no traceback)
    and resolved `--attn_implementation auto` (hf_scale.train.model.attention.resolve). `on_mesh`: the
    arguments that build it on a tensor-parallel mesh (hf_scale.train.model.parallelize.load_kwargs).
    ``sharded_precision``: the run's precision under ZeRO-3 or FSDP, which decides how a 4-bit base stores its
    weights (hf_scale.train.model.quantization)."""
    path = resolve_model_path(model_args)
    load_kwargs = dict(on_mesh or {})
    if model_args.load_in_4bit:
        from hf_scale.train.model import quantization

        load_kwargs["quantization_config"] = quantization.bnb_config(sharded_precision)
    # transformers logs its load report (a table of every missing or mismatched tensor) before hf_scale judges
    # the load: shown as usual when the load is accepted, dropped when one line names the first problem.
    with quiet.held("transformers.modeling_utils"):
        model = _from_pretrained(path, model_args, load_kwargs)
    # Training never needs the KV cache, and with it on transformers ignores packed position_ids: packed
    # examples would silently attend to each other.
    model.config.use_cache = False
    if gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs (LoRA) and with ZeRO-3's parameter hooks.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if model_args.lora_r > 0:
        model = apply_lora(model, model_args, gradient_checkpointing=gradient_checkpointing)
    return model


def apply_lora(model, model_args: ModelArguments, *, gradient_checkpointing: bool):
    from peft import LoraConfig, get_peft_model

    targets = model_args.lora_target_modules
    target_modules = (
        targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    )
    config = LoraConfig(
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=target_modules,
        task_type="CAUSAL_LM",
    )
    if target_modules != "all-linear":  # peft's own error names neither the model's modules nor all-linear
        linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                         if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] != "lm_head"})
        unknown = [t for t in target_modules if not any(n == t or n.endswith(f".{t}") for n, _ in
                                                        model.named_modules())]
        if unknown:
            raise UserError(f"--lora_target_modules={targets}: {', '.join(unknown)} is no module of the model; "
                            f"allowed: all-linear or a comma-separated list of {', '.join(linear)}")
    try:
        model = get_peft_model(model, config)
    except ValueError as error:
        raise UserError(f"--lora_target_modules={targets}: {str(error).splitlines()[0][:200]}") from None
    if gradient_checkpointing:
        # Checkpointed blocks need an input that requires grad; with frozen embeddings nothing would.
        model.enable_input_require_grads()
    return model


def decoder_layer_classes(model) -> list[str]:
    """The model's own block class names (what FSDP wraps), from `_no_split_modules`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = list(getattr(base, "_no_split_modules", None) or [])
    if not names:
        raise UserError(
            f"model class {type(base).__name__} declares no _no_split_modules; set "
            "fsdp.transformer_layer_cls_to_wrap in the hf_scale config"
        )
    return names
