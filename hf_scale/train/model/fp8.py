"""FP8 training: whether this machine can run it, and the recipe accelerate applies (both loops build their
Accelerator through :func:`with_fp8`). Which linear layers are converted is decided in hf_scale.knowledge.fp8_layers
and nowhere else (torchao's module filter, handed to accelerate here); train.py logs that decision once.
"""

from __future__ import annotations

import importlib.util

from hf_scale.errors import UserError
from hf_scale.knowledge.fp8_layers import module_filter
from hf_scale.knowledge.precision_rules import fp8_machine_refusal
from hf_scale.knowledge.rules import FP8_BACKEND_MODULES


def gpu_capability() -> tuple[int, int] | None:
    import torch

    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None


def backend_importable(backend: str) -> bool:
    return importlib.util.find_spec(FP8_BACKEND_MODULES[backend]) is not None


def check_can_run(backend: str) -> None:
    """A one-line UserError (exit 2) when this machine cannot train in FP8: called before the model loads."""
    problem = fp8_machine_refusal(backend, capability=gpu_capability(), importable=backend_importable(backend))
    if problem:
        raise UserError(problem)


def with_fp8(accelerator_kwargs: dict, spec) -> dict:
    """The Accelerator's keyword arguments with the run's FP8 (unchanged without it): accelerate's fp8 mode and
    hf_scale's recipe added to the kwargs handlers. Both loops build their Accelerator through it (the manual loop's
    `Accelerator(...)`, the Trainer's `_build_accelerator_args`): TrainingArguments knows only bf16."""
    if not spec.fp8_backend:
        return dict(accelerator_kwargs)
    handlers = [*(accelerator_kwargs.get("kwargs_handlers") or []), recipe_handler(spec.fp8_backend)]
    return {**accelerator_kwargs, "mixed_precision": "fp8", "kwargs_handlers": handlers}


def recipe_handler(backend: str):
    """accelerate's recipe kwargs for the backend (the Accelerator converts the model in `prepare`); the launch
    environment (ACCELERATE_FP8_*, from the YAML's fp8_config) fills what is not given here."""
    from accelerate.utils import AORecipeKwargs, MSAMPRecipeKwargs, TERecipeKwargs

    if backend == "torchao":
        return AORecipeKwargs(module_filter_func=module_filter("torchao"))
    return TERecipeKwargs() if backend == "te" else MSAMPRecipeKwargs()
