"""`hf-scale check`, ZeRO offload and saving (hf_scale.check.zero)."""

from __future__ import annotations

import pytest
from check_cases import (
    DS_JSON,
    DS_YAML,
    YAML_ONLY_DS,
    ZERO3_JSON,
    assert_every_fix_names_where_the_value_is,
    assert_reports_its_problem,
    check_json,
    codes,
    merged,
)

from hf_scale.check import zero

# id -> (yaml, json, training args, runner, extra CLI args, expected code, expected severity)
TRIGGERS = {
    "offload-without-ds-optimizer-trainer": (
        DS_YAML,
        merged(ZERO3_JSON, {"optimizer": None}),
        ["--optim", "sgd"],
        None,
        [],
        "offload-optimizer-swap",
        "warning",
    ),
    "offload-without-ds-optimizer-raw": (
        DS_YAML,
        {
            "train_batch_size": 8,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        },
        [],
        "deepspeed",
        [],
        "offload-optimizer-swap",
        "error",
    ),
    "offload-yaml-only": (
        merged(YAML_ONLY_DS, {"deepspeed_config": {"zero_stage": 2, "offload_optimizer_device": "cpu"}}),
        None,
        ["--gradient_accumulation_steps", "2", "--optim", "adafactor"],
        None,
        [],
        "offload-optimizer-swap",
        "warning",
    ),
    "nvme-json": (
        DS_YAML,
        merged(ZERO3_JSON, {"zero_optimization": {"offload_param": {"device": "nvme"}}}),
        [],
        None,
        [],
        "nvme-without-path",
        "error",
    ),
    "nvme-yaml": (
        merged(YAML_ONLY_DS, {"deepspeed_config": {"offload_param_device": "nvme"}}),
        None,
        [],
        None,
        [],
        "nvme-without-path",
        "error",
    ),
    "zero3-without-16bit-save": (
        DS_YAML,
        merged(ZERO3_JSON, {"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": None}}),
        [],
        None,
        [],
        "zero3-no-16bit-save",
        "warning",
    ),
    "autotuning-json": (
        DS_YAML,
        merged(DS_JSON, {"autotuning": {"enabled": True, "end_profile_step": 5}}),
        [],
        None,
        [],
        "autotuning-enabled",
        "error",
    ),
    "no-zero-section": (
        DS_YAML,
        merged(DS_JSON, {"zero_optimization": None}),
        [],
        None,
        [],
        "zero-section-missing",
        "error",
    ),
    "zero3-yaml-without-16bit-save": (
        merged(YAML_ONLY_DS, {"deepspeed_config": {"zero3_save_16bit_model": False}}),
        None,
        [],
        None,
        [],
        "zero3-no-16bit-save",
        "warning",
    ),
}

@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_each_check_reports_its_problem(case, tmp_path, monkeypatch, capsys):
    assert_reports_its_problem(TRIGGERS[case], tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_every_fix_names_the_file_and_key_that_hold_the_value(case, tmp_path, monkeypatch, capsys):
    assert_every_fix_names_where_the_value_is(TRIGGERS[case], tmp_path, monkeypatch, capsys)



@pytest.mark.parametrize("spelling", zero.GATHER_SPELLINGS)
def test_16bit_gather_is_read_in_every_spelling_deepspeed_reads(spelling, tmp_path, monkeypatch, capsys):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = {"stage": 3, spelling: True}
    assert DeepSpeedZeroConfig(**zero).gather_16bit_weights_on_model_save is True  # DeepSpeed reads it
    ds = merged(DS_JSON, {"zero_optimization": zero})
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ds)
    assert "zero3-no-16bit-save" not in codes(payload)
    ds = merged(ds, {"zero_optimization": {spelling: False}})
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ds)
    (finding,) = [f for f in payload["findings"] if f["code"] == "zero3-no-16bit-save"]
    assert finding["key"] == f"zero_optimization.{spelling}"


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused", "adagrad", "sgd", "adafactor", "rmsprop"])
def test_offload_swap_is_reported_only_for_an_optim_accelerate_replaces(optim, tmp_path, monkeypatch, capsys):
    """accelerate keeps torch's AdamW (the default --optim) and Adagrad as DeepSpeed's CPU version of the same
    algorithm, the parameter groups unchanged: no finding. Any other optimizer becomes CPU Adam: a warning that
    names the --optim and what runs instead, and no claim that betas or eps are lost."""
    ds = merged(ZERO3_JSON, {"optimizer": None})
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ds, train=["--optim", optim])
    found = [f for f in payload["findings"] if f["code"] == "offload-optimizer-swap"]
    if optim in ("adamw_torch", "adamw_torch_fused", "adagrad"):
        assert found == []
    else:
        (finding,) = found
        assert f"--optim {optim} does not run" in finding["problem"]
        assert "DeepSpeedCPUAdam in Adam mode" in finding["problem"] and "only lr" not in finding["problem"]
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ds)  # no training args: the default --optim
    assert "offload-optimizer-swap" not in codes(payload)


def test_optims_kept_under_offload_are_those_accelerate_maps_to_their_own_algorithm():
    """OFFLOAD_KEEPS_OPTIM against the libraries, for every --optim that needs no extra package: the class
    transformers builds for it, and the classes accelerate's map_pytorch_optim_to_deepspeed keeps (read from its
    source: running it builds DeepSpeed's C++ ops)."""
    import inspect
    import types

    import torch
    from accelerate.utils import deepspeed as accelerate_deepspeed
    from transformers import Trainer
    from transformers.training_args import OptimizerNames

    from hf_scale.knowledge.library_tables import OFFLOAD_KEEPS_OPTIM

    source = inspect.getsource(accelerate_deepspeed.map_pytorch_optim_to_deepspeed)
    assert "optimizer_class(optimizer.param_groups, **defaults)" in source  # the groups travel as they are
    assert "isinstance(optimizer, optim.AdamW)" in source and "isinstance(optimizer, optim.Adagrad)" in source
    kept = (torch.optim.AdamW, torch.optim.Adagrad)
    try:  # accelerate also keeps bitsandbytes' AdamW, Lion and Adagrad when they run in 32 bits
        import bitsandbytes.optim as bnb

        kept_in_32_bits: tuple = (bnb.AdamW, bnb.AdamW32bit, bnb.Lion, bnb.Lion32bit, bnb.Adagrad, bnb.Adagrad32bit)
    except ImportError:
        kept_in_32_bits = ()
    checked = 0
    for name in OptimizerNames:
        args = types.SimpleNamespace(optim=name, learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.999,
                                     adam_epsilon=1e-8, optim_args=None, weight_decay=0.0)
        try:
            cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
        except (ImportError, ValueError, TypeError, AttributeError):
            continue  # needs a package not installed here (bitsandbytes, torchao, ...) or a model
        if not isinstance(cls, type):
            continue
        checked += 1
        bits = kwargs.get("optim_bits", 32)
        keeps = issubclass(cls, kept) or (issubclass(cls, kept_in_32_bits) and bits == 32)
        assert (name.value in OFFLOAD_KEEPS_OPTIM) == keeps, name
    assert checked >= 6


def test_offload_swap_runs_the_adamw_groups_betas_and_eps():
    """The swap itself, with the real libraries: the Trainer's AdamW for --adam_beta1 0.5 --adam_beta2 0.6
    --adam_epsilon 1e-3 goes through accelerate's map_pytorch_optim_to_deepspeed; DeepSpeedCPUAdam (AdamW mode) then
    holds every group's lr, betas, eps and weight_decay and takes the same steps as torch's AdamW. (Builds DeepSpeed's
    cpu_adam op once: JIT, C++.)"""
    import types

    import torch
    from accelerate.utils.deepspeed import map_pytorch_optim_to_deepspeed
    from transformers import Trainer

    torch.manual_seed(0)
    args = types.SimpleNamespace(optim="adamw_torch", learning_rate=0.05, adam_beta1=0.5, adam_beta2=0.6,
                                 adam_epsilon=1e-3, optim_args=None, weight_decay=0.0)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    start = [torch.randn(16), torch.randn(4)]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    reference = [torch.nn.Parameter(t.clone()) for t in start]

    def groups(params):  # decayed weights and undecayed biases, as the Trainer groups them
        return [{"params": [params[0]], "weight_decay": 0.1}, {"params": [params[1]], "weight_decay": 0.0}]

    defaults = [torch.nn.Parameter(t.clone()) for t in start]
    swapped = map_pytorch_optim_to_deepspeed(cls(groups(ours), **kwargs))
    torch_adamw = cls(groups(reference), **kwargs)
    default_adamw = cls(groups(defaults), lr=0.05)  # torch's default betas and eps
    assert type(swapped).__name__ == "DeepSpeedCPUAdam" and swapped.adam_w_mode
    assert [(g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"]) for g in swapped.param_groups] == [
        (0.05, (0.5, 0.6), 1e-3, 0.1), (0.05, (0.5, 0.6), 1e-3, 0.0)]
    for _ in range(5):
        grads = [torch.randn_like(t) for t in start]
        for params, optimizer in ((ours, swapped), (reference, torch_adamw), (defaults, default_adamw)):
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad.clone()
            optimizer.step()
    for got, expected in zip(ours, reference, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # With the default betas/eps the steps differ: the groups' values are what ran.
    assert not torch.allclose(ours[0], defaults[0], rtol=1e-3, atol=1e-4)
