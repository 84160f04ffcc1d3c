"""The save check (hf_scale/train/save.py): written safetensors vs the trained tensors, exactly, one tensor at a
time. Saves are broken on purpose (missing, empty, `_orig_mod.`-prefixed, wrong values, empty adapter) and the
check must name each defect; correct saves in fp32, bf16, sharded, tied and LoRA form must pass bit-exactly.
The end-to-end case is a real ZeRO-3 run that writes no weights."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from train_helpers import TRAIN_PY, generate_config, run
from transformers import LlamaConfig, LlamaForCausalLM

from hf_scale.train.save import (
    ADAPTER_FILE,
    MODEL_FILE,
    MODEL_INDEX,
    REPORT_FILE,
    failure_message,
    live_tensors,
    verify_saved_model,
)


def tiny_llama(*, tie: bool = False, dtype=torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    return LlamaForCausalLM(config).to(dtype)


def check(out, model) -> dict:
    report = verify_saved_model(out, model, is_main_process=True)
    assert json.loads((out / REPORT_FILE).read_text()) == report
    return report


def rewrite(out, change) -> None:
    tensors = load_file(out / MODEL_FILE)
    save_file(change(tensors), out / MODEL_FILE, metadata={"format": "pt"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_correct_save_passes_bit_exactly_with_its_costs_reported(dtype, tmp_path):
    model = tiny_llama(dtype=dtype)
    model.save_pretrained(tmp_path)
    report = check(tmp_path, model)
    assert report["ok"] and report["problems"] == {}
    assert report["tensors_checked"] == report["tensors_expected"] == len(model.state_dict())
    assert report["bytes_read"] == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert report["saved_dtypes"] == [str(dtype).removeprefix("torch.")]
    assert report["seconds"] >= 0 and report["peak_host_rss_bytes"] >= report["largest_tensor_bytes"] > 0


def test_fp32_weights_saved_in_bf16_compare_after_the_cast(tmp_path):
    """ZeRO-3 saves its 16-bit weights: the trained tensor is cast to the saved dtype, then compared exactly."""
    model = tiny_llama()
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    model.float()  # the cast back is exact, the comparison casts down again
    assert check(tmp_path, model)["ok"]


def test_tied_weights_and_sharded_saves_pass(tmp_path):
    model = tiny_llama(tie=True)
    assert any(len(names) == 2 for names, _ in live_tensors(model))  # embed_tokens + lm_head: one tensor
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / MODEL_INDEX).is_file()
    report = check(tmp_path, model)
    assert report["ok"] and len(report["files"]) > 1


def test_a_missing_tensor_is_named(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path)
    rewrite(tmp_path, lambda t: {k: v for k, v in t.items() if k != "model.norm.weight"})
    report = check(tmp_path, model)
    assert not report["ok"] and report["problems"] == {"missing": ["model.norm.weight"]}
    message = failure_message(report, tmp_path)
    assert "\n" not in message and "1 tensor(s) missing (e.g. model.norm.weight)" in message


def test_an_empty_zero3_style_save_is_caught(tmp_path):
    """What a ZeRO-3 save without gathering used to write: every weight a 0-element placeholder."""
    model = tiny_llama()
    model.save_pretrained(tmp_path)
    rewrite(tmp_path, lambda t: {k: torch.empty(0, dtype=v.dtype) for k, v in t.items()})
    report = check(tmp_path, model)
    assert not report["ok"] and len(report["problems"]["wrong_shape"]) == len(model.state_dict())
    assert "saved [0], trained [64, 32]" in report["problems"]["wrong_shape"][0]
    assert "another shape (empty or partial save)" in failure_message(report, tmp_path)


def test_torch_compile_prefix_is_caught(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path)
    rewrite(tmp_path, lambda t: {f"_orig_mod.{k}": v for k, v in t.items()})
    problems = check(tmp_path, model)["problems"]
    assert set(problems) == {"missing", "unexpected"}
    assert all(key.startswith("_orig_mod.") for key in problems["unexpected"])


def test_one_value_off_by_one_ulp_is_caught(tmp_path):
    model = tiny_llama(dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)

    def nudge(tensors):
        weight = tensors["model.layers.1.mlp.up_proj.weight"]
        weight[3, 5] = torch.nextafter(weight[3, 5].float(), torch.tensor(1.0)).to(weight.dtype) + 2**-10
        return tensors

    rewrite(tmp_path, nudge)
    report = check(tmp_path, model)
    (wrong,) = report["problems"]["wrong_values"]
    assert wrong.startswith("model.layers.1.mlp.up_proj.weight (1 of 2048 values")


@pytest.mark.parametrize("damage", ["truncated-file", "bad-index"])
def test_a_damaged_save_is_reported_not_raised(damage, tmp_path):
    """Under ZeRO-3 the other ranks wait in the next gather: the main process must finish the walk."""
    model = tiny_llama()
    model.save_pretrained(tmp_path, max_shard_size="20KB" if damage == "bad-index" else "50GB")
    if damage == "bad-index":
        (tmp_path / MODEL_INDEX).write_text("{not json")
    else:
        data = (tmp_path / MODEL_FILE).read_bytes()
        (tmp_path / MODEL_FILE).write_bytes(data[: len(data) // 2])
    report = check(tmp_path, model)
    assert not report["ok"] and report["problems"]["unreadable"]
    assert "could not be read" in failure_message(report, tmp_path)


def test_no_weights_file_at_all(tmp_path):
    model = tiny_llama()
    model.config.save_pretrained(tmp_path)
    report = check(tmp_path, model)
    assert not report["ok"] and report["files"] == []
    assert f"has no {MODEL_FILE} or {MODEL_INDEX}" in failure_message(report, tmp_path)


@pytest.fixture
def lora_model():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules="all-linear", task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()  # trained, not peft's zero init
    return model


def test_a_lora_adapter_is_checked_under_peft_names(lora_model, tmp_path):
    lora_model.save_pretrained(tmp_path)
    report = check(tmp_path, lora_model)
    assert report["ok"] and report["what"] == "LoRA adapter" and report["files"] == [ADAPTER_FILE]
    assert report["tensors_checked"] == sum(1 for n, _ in lora_model.named_parameters() if "lora_" in n)


@pytest.mark.parametrize("defect", ["no-tensors", "zero-element"])
def test_an_empty_lora_adapter_is_caught(defect, lora_model, tmp_path):
    lora_model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / ADAPTER_FILE)
    broken = {} if defect == "no-tensors" else {k: torch.empty(0) for k in tensors}
    save_file(broken, tmp_path / ADAPTER_FILE, metadata={"format": "pt"})
    report = check(tmp_path, lora_model)
    kind = "missing" if defect == "no-tensors" else "wrong_shape"
    assert not report["ok"] and len(report["problems"][kind]) == len(tensors)
    assert "the saved LoRA adapter" in failure_message(report, tmp_path)


def test_train_py_exits_1_with_one_line_when_zero3_writes_no_weights(tmp_path):
    """A real empty ZeRO-3 save (stage3_gather_16bit_weights_on_model_save=false; the Trainer writes the
    config and no weights): one process, plain python, DeepSpeed over gloo."""
    generate_config(tmp_path, "nogather", preset="zero3",
                    sets=["topology.processes_per_machine=1", "precision='no'",
                          "deepspeed.gather_16bit_weights_on_save=false"])
    out = tmp_path / "out"
    result = run([sys.executable, TRAIN_PY, "--max_steps", "1", "--deepspeed",
                  str(tmp_path / "ds_configs" / "nogather.json"), "--output_dir", str(out)], timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert errors == [f"hf_scale: ERROR: the saved model in {out} has no {MODEL_FILE} or {MODEL_INDEX} "
                      "(ZeRO-3 writes no weights without stage3_gather_16bit_weights_on_model_save: set "
                      "deepspeed.gather_16bit_weights_on_save=true, or turn the last checkpoint into a model with "
                      "`hf-scale export`)"]
    assert "Traceback" not in result.stderr
    assert json.loads((out / REPORT_FILE).read_text())["ok"] is False
    assert json.loads((out / "train_summary.json").read_text())["saved_model_verified"] is False
