"""What train.py refuses of --load_in_4bit before anything loads, in its own words (hf_scale.contract.qlora_refusals):
train.py's start and `hf-scale check` ask these functions."""

from __future__ import annotations

import pytest

from hf_scale.contract import qlora_refusals


def test_refusals_name_the_combination():
    assert qlora_refusals.refusal(load_in_4bit=False, lora_r=0, fp8_backend=None) is None
    assert qlora_refusals.refusal(load_in_4bit=True, lora_r=8, fp8_backend=None) is None
    no_lora = qlora_refusals.refusal(load_in_4bit=True, lora_r=0, fp8_backend=None)
    assert "--lora_r=0" in no_lora and "cannot be fully fine-tuned" in no_lora
    assert "fp8" in qlora_refusals.refusal(load_in_4bit=True, lora_r=8, fp8_backend="torchao")


NEW = {"accelerate": "1.15.0", "peft": "0.21.2"}


@pytest.mark.parametrize(("fsdp_version", "installed", "expected"), [
    (None, {}, None),  # DDP, ZeRO-3, one process: no FSDP
    (2, NEW, None),
    (2, {"accelerate": "1.14.0", "peft": "0.19.0"}, None),
    (2, {**NEW, "accelerate": "1.13.2"}, "needs accelerate >= 1.14 (installed: 1.13.2)"),
    (2, {**NEW, "peft": "0.18.1"}, "needs peft >= 0.19 (installed: 0.18.1)"),
    (2, {"accelerate": "1.6.0"}, "needs accelerate >= 1.14 (installed: 1.6.0) and peft >= 0.19 (installed: none)"),
    (1, NEW, "--load_in_4bit with FSDP version 1"),
], ids=["no-fsdp", "fsdp2", "fsdp2-first-releases", "fsdp2-old-accelerate", "fsdp2-old-peft", "fsdp2-both-old",
        "fsdp1"])
def test_sharding_refusal_names_fsdp1_and_the_versions_fsdp2_needs(fsdp_version, installed, expected):
    problem = qlora_refusals.sharding_refusal(fsdp_version, installed)
    assert problem is None if expected is None else expected in problem and "\n" not in problem
    if expected and fsdp_version == 2:
        assert "pip install -U 'accelerate>=1.14' 'peft>=0.19'" in problem


def test_sharding_refusal_names_the_hf_scale_configs_fsdp_version_when_it_set_fsdp1():
    problem = qlora_refusals.sharding_refusal(1, NEW, from_hf_scale_config=True)
    assert "(the --hf_scale_config's fsdp.version)" in problem and "set fsdp.version: 2" in problem
    assert "accelerate config" not in problem
