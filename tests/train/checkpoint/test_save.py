"""The save check (train/checkpoint/save.py): written safetensors vs the trained tensors, exactly, one tensor at a
time. Saves are broken on purpose (missing, empty, `_orig_mod.`-prefixed, wrong values, empty adapter) and the
check must name each defect; correct saves in fp32, bf16, sharded, tied and LoRA form must pass bit-exactly.
The end-to-end case is a real ZeRO-3 run without 16-bit gathering, which saves its final step as a checkpoint
instead (hf_scale/train/checkpoint/final_checkpoint.py)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from train_helpers import REPO, generate_config, logits, run, run_ok, tiny_moe
from transformers import LlamaConfig, LlamaForCausalLM

from hf_scale.contract import checkpoint_layout, checkpoint_verification
from hf_scale.knowledge import rules
from hf_scale.train.checkpoint import final_checkpoint
from hf_scale.train.checkpoint.save import (
    ADAPTER_FILE,
    MODEL_FILE,
    MODEL_INDEX,
    REPORT_FILE,
    failure_message,
    live_tensors,
    verify_saved_model,
)

ONE_PROCESS = SimpleNamespace(num_processes=1, process_index=0, is_main_process=True)


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


def test_fused_moe_experts_are_checked_as_the_per_expert_tensors_transformers_saves(tmp_path):
    """transformers 5 keeps a MoE model's experts fused at run time (mlp.experts.gate_up_proj) and save_pretrained
    writes them per expert: every piece is compared, and a defect is named by the saved tensor's name."""
    model, _ = tiny_moe()
    model.save_pretrained(tmp_path)
    report = check(tmp_path, model)
    assert report["ok"] and report["tensors_checked"] == report["tensors_expected"] == len(model.state_dict())
    assert report["bytes_read"] == sum(t.numel() * t.element_size() for t in model.state_dict().values())

    def damage(tensors):
        tensors["model.layers.0.mlp.experts.2.up_proj.weight"][1, 3] += 1
        del tensors["model.layers.1.mlp.experts.3.down_proj.weight"]
        return tensors

    rewrite(tmp_path, damage)
    problems = check(tmp_path, model)["problems"]
    assert problems["missing"] == ["model.layers.1.mlp.experts.3.down_proj.weight"]
    assert [w.split(" (")[0] for w in problems["wrong_values"]] == ["model.layers.0.mlp.experts.2.up_proj.weight"]
    assert set(problems) == {"missing", "wrong_values"}


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


@pytest.mark.parametrize(("zero", "without_gathering"), [
    ({"stage": 3}, True),
    ({"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}, True),
    ({"stage": 3, "stage3_gather_16bit_weights_on_model_save": "auto"}, True),  # accelerate fills false
    ({"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}, False),
    ({"stage": 3, "gather_16bit_weights_on_model_save": True}, False),
    ({"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}, False),
    ({"stage": 2}, False),
])
def test_zero3_without_gathering_is_read_as_deepspeed_reads_it(zero, without_gathering):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    assert rules.zero3_without_gathering({"zero_optimization": zero}) is without_gathering
    assert rules.zero3_without_gathering(None) is False
    if zero["stage"] == 3 and zero.get("stage3_gather_16bit_weights_on_model_save") != "auto":
        assert DeepSpeedZeroConfig(**zero).gather_16bit_weights_on_model_save is not without_gathering


def test_the_export_command_keeps_a_16_bit_runs_dtype():
    final = Path("/runs/a b/checkpoint-9")
    assert final_checkpoint.export_command(final, "/runs/a b", "bf16") == (
        "hf-scale export '/runs/a b/checkpoint-9' '/runs/a b/model' --dtype bf16")
    assert final_checkpoint.export_command(final, "/runs/a b", "no").endswith("'/runs/a b/model'")


# ZeRO-3 without 16-bit gathering, one real run per loop. The Trainer saves nothing during the run (--save_strategy
# no): its only checkpoint is the one the final save writes. The manual loop saves at step 2 (--save_steps 2 does not
# land on the last step, 3) and keeps one checkpoint (--save_total_limit 1): the final step's, nothing else.
NO_GATHER_RUNS = {"trainer": ["--save_strategy", "no"], "accelerate": ["--save_steps", "2", "--save_total_limit", "1"]}


@pytest.mark.parametrize("loop", sorted(NO_GATHER_RUNS))
def test_zero3_without_gathering_ends_with_the_final_checkpoint_which_exports_to_the_trained_model(loop, tmp_path):
    """stage3_gather_16bit_weights_on_model_save=false (deepspeed.gather_16bit_weights_on_save=false): one process,
    plain python, DeepSpeed over gloo. Exit 0; the final step's checkpoint, complete and verified; no safetensors;
    one line up front and one last line naming the checkpoint and the export command; that command's model
    computes the logits the live trained model computed before the final save (tests/_trained_logits_worker.py)."""
    generate_config(tmp_path, "nogather", preset="zero3",
                    sets=["topology.processes_per_machine=1", "precision='no'",
                          "deepspeed.gather_16bit_weights_on_save=false"])
    out, trained_logits = tmp_path / "out", tmp_path / "trained_logits.pt"
    result = run([sys.executable, str(REPO / "tests" / "_trained_logits_worker.py"), str(trained_logits),
                  "--max_steps", "3", "--loop", loop, "--deepspeed", str(tmp_path / "ds_configs" / "nogather.json"),
                  "--output_dir", str(out), *NO_GATHER_RUNS[loop]], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "ERROR" not in result.stderr
    # No empty weights file written and deleted: not transformers' save_model fallback, which writes the engine's
    # checkpoint that the Trainer's _save_checkpoint then writes again (HfScaleTrainer.save_model).
    assert "Writing model shards" not in result.stderr

    final = out / "checkpoint-3"
    assert checkpoint_layout.complete_checkpoints(out) == [final]
    layout = checkpoint_layout.detect_layout(final)
    assert (layout.kind, layout.weights, layout.loop) == (checkpoint_layout.CHECKPOINT, checkpoint_layout.DEEPSPEED,
                                                          loop)
    assert checkpoint_verification.verify(final, ONE_PROCESS) is None  # what --resume_from_checkpoint checks
    assert checkpoint_verification.read_state(final)["step"] == 3
    # No Hugging Face weights, and no DeepSpeed checkpoint outside checkpoint-3 (transformers' own fallback).
    assert not list(out.rglob("*.safetensors")) and not (out / "latest").exists()

    command = shlex.join(["hf-scale", "export", str(final), str(out / "model")])
    notice = [line for line in result.stderr.splitlines()
              if "the final model will be the last step's DeepSpeed checkpoint" in line]
    assert notice == [f"hf_scale: ZeRO-3 without 16-bit gathering on save (stage3_gather_16bit_weights_on_model_save "
                      f"false): the final model will be the last step's DeepSpeed checkpoint {out}/checkpoint-STEP, "
                      "not safetensors; `hf-scale export` turns it into safetensors after the run (set "
                      "stage3_gather_16bit_weights_on_model_save true to save safetensors at the end instead)"]
    last = result.stdout.strip().splitlines()[-1]
    assert [line for line in (result.stdout + result.stderr).splitlines() if command in line] == [last]
    assert last.startswith("hf_scale: 3 steps, final loss ") and last.endswith(
        f"; final step saved as the DeepSpeed checkpoint {final} (ZeRO-3 without 16-bit gathering: no safetensors), "
        f"verified ({len(checkpoint_layout.read_manifest(final)[0])} files, "
        f"{json.loads((out / REPORT_FILE).read_text())['seconds']:.1f} s); safetensors with: {command}")

    report = json.loads((out / REPORT_FILE).read_text())
    assert report["ok"] is True and report["problems"] == {}
    assert (report["what"], report["checkpoint"], report["step"], report["weights"]) == ("checkpoint", str(final), 3,
                                                                                        "deepspeed")
    assert report["export_command"] == command and report["bytes_checked"] > 0
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["model_dir"] is None and summary["saved_model_verified"] is True
    assert summary["final_save"] == {"verified": True, "what": "checkpoint", "checkpoint": str(final), "step": 3,
                                     "weights": "deepspeed", "export_command": command}

    run_ok([sys.executable, "-m", "hf_scale", *shlex.split(command)[1:]], timeout=180)
    torch.testing.assert_close(logits(out / "model"), torch.load(trained_logits), rtol=1e-5, atol=1e-5)
