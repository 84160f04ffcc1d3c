"""Exact parameter counts of a causal LM, from its config alone.

The model is built on PyTorch's meta device (shapes, no storage, nothing downloaded but ``config.json``),
so counts are those of the real ``AutoModelForCausalLM`` class: tied embeddings are counted once, biases,
norms and any architecture quirk included.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub.errors import StrictDataclassError

from hf_scale.config import expert_parallel
from hf_scale.errors import UserError
from hf_scale.files.reading import load_json, read_text

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# torch and transformers are imported where a model is built or a config read: a mistyped MODEL is reported
# before they load.


@dataclass(frozen=True)
class ModelShapes:
    """What the memory estimates need to know about a model."""

    name: str
    """How the user named the model (Hub id or path)."""
    model_type: str
    """transformers model_type, e.g. llama."""
    decoder_layer_class: str
    """Class of the repeated decoder block (FSDP wrap unit), from the model's _no_split_modules."""
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    param_numels: tuple[int, ...]
    """Element count of every unique parameter tensor (tied ones once), in model order."""
    decoder_layer_params: int
    """Parameters of one decoder layer (the unit ZeRO-3/FSDP gathers at a time)."""
    largest_layer_params: int
    """Largest parameter count directly owned by one module (DeepSpeed's "largest layer", usually the
    embedding or lm_head)."""
    lora_params_per_rank: int
    """LoRA adapter parameters per unit of rank r: sum of (in + out) over the decoder layers' nn.Linear
    modules (PEFT target_modules="all-linear", which leaves lm_head out)."""
    linear_params: int = 0
    """Weights of the decoder layers' nn.Linear modules: what bitsandbytes quantizes for --load_in_4bit/8bit
    (transformers keeps the embeddings, the norms and lm_head in the compute dtype)."""
    max_position_embeddings: int | None = None
    """The longest sequence the model was trained on (None: its config does not say)."""
    num_experts: int | None = None
    """Routed experts per MoE layer (None: a dense model), under the names transformers' MoE configs use."""
    experts_per_token: int = 0
    """Routed experts each token runs through (top-k; 0 for a dense model)."""
    expert_params: int = 0
    """Weights of the routed experts, all MoE layers together (the parameters under ``.experts.``, shared experts
    not among them: they run for every token, like the dense part)."""
    moe_layers: int = 0
    """Decoder layers with routed experts (DeepSeek-style models keep the first ones dense)."""
    shared_expert_width: int = 0
    """Intermediate width of the shared experts every token runs through (Qwen2-MoE, DeepSeek), 0 without."""
    ep_plan: bool = False
    """transformers has an expert-parallel plan for the model (its config's base_model_ep_plan)."""

    @property
    def total_params(self) -> int:
        return sum(self.param_numels)

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts and self.expert_params)

    @property
    def expert_layer_params(self) -> int:
        """Routed expert weights of one MoE layer (what FSDP gathers of it without expert parallelism)."""
        return self.expert_params // self.moe_layers if self.moe_layers else 0

    @property
    def active_params(self) -> int:
        """Weights one token runs through: the dense part and its top-k routed experts (all of them when dense).
        What tokens/s, MFU and 6 x N FLOPs of an MoE model count."""
        if not self.is_moe:
            return self.total_params
        return self.total_params - self.expert_params + self.expert_params * self.experts_per_token // self.num_experts

    @property
    def expert_width(self) -> int:
        """Intermediate width of one routed expert (its gate, up and down projections: 3 x hidden x width)."""
        if not self.is_moe:
            return 0
        return self.expert_layer_params // (self.num_experts * 3 * self.hidden_size)

    @property
    def mlp_width(self) -> int:
        """The MLP intermediate width one token's activations and FLOPs see, averaged over the layers: the dense
        intermediate_size, or in an MoE layer top-k routed experts plus the shared ones."""
        if not self.is_moe:
            return self.intermediate_size
        moe = self.experts_per_token * self.expert_width + self.shared_expert_width
        dense = self.num_layers - self.moe_layers
        return (self.moe_layers * moe + dense * self.intermediate_size) // self.num_layers

    def lora_params(self, rank: int) -> int:
        """Trainable adapter parameters for LoRA rank ``rank`` (A: r x in, B: out x r per linear)."""
        return rank * self.lora_params_per_rank


HUB_TIMEOUT_S = 10.0
"""Seconds one request to the Hub may take. The planner asks once, without huggingface_hub's retries (which
add up to half a minute without a network)."""


def load_model_config(model: str) -> PretrainedConfig:
    """MODEL as a local model directory or config.json (an existing path always wins), else a Hub id whose
    config.json is taken from the local cache or fetched (one request, no retries). A name that is no valid
    Hub id, or that names a local folder (``models/llama3_8b`` where ``models/`` exists), is a missing path."""
    path = Path(model).expanduser()
    if path.exists() and not path.is_dir():  # a file; a FIFO or device is refused when it is read
        return _config_from_file(path, model)
    if path.is_dir():
        if not os.path.lexists(path / "config.json"):  # one that is not a regular file is refused when read
            raise UserError(f"MODEL {model!r}: directory has no config.json (pass a model directory or a config.json)")
        return _config_from_file(path / "config.json", model)
    local = _local_path_reason(model)
    if local is not None:
        raise UserError(
            f"MODEL {model!r}: no such file or directory ({local}expected a Hub id, a model directory or a "
            "config.json)"
        )
    return _config_from_file(_hub_config_json(model), model)


def _local_path_reason(model: str) -> str | None:
    """Why ``model``, which does not exist, is a mistyped local path and not a Hub id, as the start of the error's
    parenthesis ("" when it is plainly a path; None: it is a Hub id).
    transformers' rule is that an existing path wins; a name that cannot be a repository id, or whose first
    component is a folder here, was meant as a path too."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if model.startswith((".", "/", "~")) or "\\" in model or model.endswith(".json"):
        return ""
    if model.count("/") > 1:
        return "a Hub id is NAME or ORG/NAME; "
    try:
        validate_repo_id(model)
    except HFValidationError:
        return "nor a valid Hub id; "
    folder, _, name = model.rpartition("/")
    if folder and Path(folder).is_dir():
        nearest = difflib.get_close_matches(name, [p.name for p in Path(folder).iterdir()], n=1, cutoff=0.6)
        hint = f" (did you mean {folder}/{nearest[0]}?)" if nearest else ""
        return f"{folder}/ is a folder here, so this is a local path{hint}, not a Hub id; "
    return None


def _hub_config_json(model: str) -> Path:
    """config.json of the Hub repository ``model``: from the local cache, else downloaded after one request
    that says whether the Hub has it. One line for every failure."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import (
        GatedRepoError,
        HTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
    )

    offline_hint = ("; offline, download config.json elsewhere and pass its path (hf-scale plan ./config.json) or a "
                    "local model directory")
    try:
        return Path(hf_hub_download(model, "config.json", local_files_only=True))
    except LocalEntryNotFoundError:
        pass  # not cached
    try:
        get_hf_file_metadata(hf_hub_url(model, "config.json"), timeout=HUB_TIMEOUT_S)
        return Path(hf_hub_download(model, "config.json", etag_timeout=HUB_TIMEOUT_S))
    except OfflineModeIsEnabled:
        reason = "not in the local cache, and HF_HUB_OFFLINE is set" + offline_hint
    except GatedRepoError:
        reason = "a gated repository: accept its license on the Hub and log in (hf auth login or HF_TOKEN)"
    except RepositoryNotFoundError:
        reason = "no such repository on the Hub (or a private one: log in with hf auth login or HF_TOKEN)"
    except RemoteEntryNotFoundError:
        reason = "the Hub repository has no config.json"
    except (HTTPError, OSError, ValueError) as error:
        detail = " ".join(str(error).split())[:160] or type(error).__name__
        reason = f"cannot reach the Hugging Face Hub ({detail})" + offline_hint
    raise UserError(f"MODEL {model!r}: cannot get its config.json: {reason}")


def read_config_json(path: Path, owner: str) -> dict[str, Any]:
    """A local config.json as a dict: read strictly (hf_scale.files.reading: a FIFO or device refused without blocking,
    UTF-8, no NaN, no duplicate keys), an object with a model_type, every dimension checked (check_dimensions).
    The one reading of a model's config.json for `hf-scale plan`, train.py and `hf-scale export`; ``owner`` (the
    flag or argument that named the model) starts each one-line error."""
    text = read_text(path, f"{owner}:", expected="a transformers config.json")
    data: Any = load_json(text, f"{owner}: {path}")
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise UserError(f'{owner}: {path} has no "model_type" (expected a transformers config.json)')
    check_dimensions(data, owner)  # before transformers builds anything from them
    return data


def _config_from_file(path: Path, model: str) -> PretrainedConfig:
    data = read_config_json(path, f"MODEL {model!r}")
    model_type = data.pop("model_type")
    from transformers import CONFIG_MAPPING, AutoConfig

    if model_type not in CONFIG_MAPPING:
        raise UserError(f"MODEL {model!r}: model_type {model_type!r} is unknown to transformers {_version()}")
    try:
        return AutoConfig.for_model(model_type, **data)
    except CONFIG_ERRORS as error:  # transformers' typed configs reject a value
        raise UserError(f"MODEL {model!r}: {path}: {' '.join(str(error).split())[:200]}") from None


# What transformers' config classes and model constructors raise on values they cannot use: building a
# config or a model runs the architecture's own code on the user's values.
CONFIG_ERRORS = (ValueError, KeyError, TypeError, AttributeError, IndexError, AssertionError, ZeroDivisionError,
                 RuntimeError, StrictDataclassError)


def _version() -> str:
    import transformers

    return transformers.__version__


# Bounds on what the planner builds (on the meta device, but module by module: 10^6 layers take minutes).
# Far beyond any published model (Llama-3.1-405B: 126 layers, 16384 hidden, 128256 vocabulary).
DIMENSION_BOUNDS = {
    "num_hidden_layers": 512,
    "hidden_size": 131_072,
    "intermediate_size": 1_048_576,
    "vocab_size": 4_194_304,
    "num_attention_heads": 2_048,
    "num_key_value_heads": 2_048,
    "head_dim": 4_096,
    "max_position_embeddings": 2**30,  # 0 would train, with positions no model has (Llama 4 Scout: 10M)
    "num_local_experts": 1_024,  # Mixtral
    "num_experts": 1_024,  # Qwen-MoE
    "n_routed_experts": 1_024,  # DeepSeek
}
MAX_EXPERT_LAYERS = 65_536
"""Layers x experts: one module each (DeepSeek-V3: 61 x 256)."""


def check_dimensions(config: dict[str, Any], where: str) -> None:
    """Every size a model is built from is a positive integer within DIMENSION_BOUNDS (nested text configs
    of multimodal models included); one line, starting with ``where``, naming the first that is not. The one
    rule for `hf-scale plan` and train.py: transformers would raise a TypeError or ZeroDivisionError."""
    for section in (config, *(v for v in config.values() if isinstance(v, dict))):
        for name, bound in DIMENSION_BOUNDS.items():
            value = section.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
                raise UserError(f"{where}: {name}={value!r} is invalid: allowed an integer from 1 to {bound}")
        experts = max((section.get(k) or 1) for k in ("num_local_experts", "num_experts", "n_routed_experts"))
        if (section.get("num_hidden_layers") or 1) * experts > MAX_EXPERT_LAYERS:
            raise UserError(
                f"{where}: num_hidden_layers x experts = {section['num_hidden_layers']} x {experts} is more "
                f"than the {MAX_EXPERT_LAYERS} allowed"
            )


def model_shapes(model: str | PretrainedConfig, *, name: str | None = None) -> ModelShapes:
    """Build the causal LM on the meta device and measure it."""
    config = load_model_config(model) if isinstance(model, str) else model
    import torch
    from transformers import AutoModelForCausalLM

    name = name or (model if isinstance(model, str) else config.model_type)
    try:
        check_dimensions(config.to_dict(), f"MODEL {name!r}")  # a Hub config too
        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(config)
    except ValueError as error:
        raise UserError(
            f"MODEL {name!r}: transformers has no causal LM for this config ({' '.join(str(error).split())[:160]})"
        ) from None
    except CONFIG_ERRORS as error:  # e.g. hidden_size not divisible by num_attention_heads
        detail = " ".join(str(error).split())[:160]
        raise UserError(f"MODEL {name!r}: transformers cannot build a model from this config ({detail})") from None
    unique = {id(p): p for p in lm.parameters()}  # parameters() already yields a tied tensor once
    layer_classes = list(getattr(lm, "_no_split_modules", None) or [])
    layers = [m for m in lm.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise UserError(f"MODEL {name!r}: cannot find its decoder layers (_no_split_modules={layer_classes})")
    layer = layers[0]
    linears = [m for block in layers for m in block.modules() if isinstance(m, torch.nn.Linear)]
    lora_per_rank = sum(m.in_features + m.out_features for m in linears)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    return ModelShapes(
        name=name,
        model_type=config.model_type,
        decoder_layer_class=type(layer).__name__,
        num_layers=len(layers),
        hidden_size=text.hidden_size,
        intermediate_size=getattr(text, "intermediate_size", 4 * text.hidden_size),
        num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        vocab_size=text.vocab_size,
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        param_numels=tuple(p.numel() for p in unique.values()),
        decoder_layer_params=sum(p.numel() for p in layer.parameters()),
        largest_layer_params=max(sum(p.numel() for p in m.parameters(recurse=False)) for m in lm.modules()),
        lora_params_per_rank=lora_per_rank,
        linear_params=sum(m.weight.numel() for m in linears),
        max_position_embeddings=getattr(text, "max_position_embeddings", None),
        **_expert_facts(lm, config),
    )


def _expert_facts(lm, config) -> dict[str, int | None]:
    """ModelShapes' MoE fields, measured on the meta model: the routed experts' weights (transformers 5 keeps them
    fused, ``mlp.experts.gate_up_proj`` / ``down_proj``), the layers that hold them; the counts from its config."""
    routed, active, shared = expert_parallel.expert_counts(config)
    if routed is None:
        return {"num_experts": None}
    experts = {name.split(".experts.")[0]: 0 for name, _ in lm.named_parameters()
               if ".experts." in name and "shared" not in name}
    total = sum(p.numel() for name, p in lm.named_parameters() if ".experts." in name and "shared" not in name)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    width = getattr(text, "moe_intermediate_size", None) or getattr(text, "intermediate_size", 0)
    shared_width = shared * width + (getattr(text, "shared_expert_intermediate_size", None) or 0)
    return {"num_experts": routed, "experts_per_token": active or 1, "expert_params": total,
            "moe_layers": len(experts), "shared_expert_width": shared_width,
            "ep_plan": bool(getattr(text, "base_model_ep_plan", None))}
