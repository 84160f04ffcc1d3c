"""QLoRA (`train.py --load_in_4bit`) on CPU with bitsandbytes' own NF4 layers: the refusals, the quantization
config transformers receives, a real one-process run (4-bit base, non-empty adapter), 2-process DDP, ZeRO-3 and
FSDP2 runs (real torchrun, gloo) that equal it, and `hf-scale export --lora merged` (`--merge`) of the checkpoints
of each loop and engine (the adapter read from wherever the checkpoint keeps its weights).

Tolerance of the 2-process comparisons: the 4-bit base is the same on every process (NF4 quantization of the same
weights is deterministic) and the LoRA math is the same; what differs is bf16 compute (the 4-bit layers' compute
dtype, and --bf16) over micro-batches of 4 instead of 8, which changes how the GEMMs block their sums. bf16 keeps 8
significant bits (epsilon 2**-7), but the loss is a mean over ~600 tokens of fp32 cross-entropy, so the per-step
losses agree far closer: observed within 3e-5 relative; rtol 2e-4 bounds that with room and is still ~40 times
tighter than one bf16 rounding (an unsynchronised rank or a wrong batch moves the loss by > 1e-3)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import PROBE_IDS, TRAIN_PY, child_env, generate_config, losses, run_in_process, run_ok, torchrun

from hf_scale.contract import qlora_refusals
from hf_scale.contract.checkpoint_layout import DCP_DIR
from hf_scale.contract.embedded_assets import EMBEDDED_MODEL_DIR
from hf_scale.train.model import quantization

pytest.importorskip("bitsandbytes")  # the test extra installs it (hf-scale[qlora])

STEPS = 3
COMMON = ["--load_in_4bit", "--lora_r", "4", "--max_steps", str(STEPS), "--bf16", "--learning_rate", "1e-3",
          "--seed", "11", "--lr_scheduler_type", "constant", "--save_steps", str(STEPS)]
LOSS_RTOL = 2e-4  # see the module docstring


def test_fsdp1_is_refused_by_train_py_before_anything_loads(tmp_path):
    """`accelerate launch` (its own code, one process) with an FSDP YAML that leaves fsdp_version out: accelerate's
    FSDP1. train.py refuses --load_in_4bit in one line, exit 2, on any machine (before the no-GPU FSDP refusal)."""
    import yaml
    from train_helpers import launcher_command, run, training_traceback_frames

    launch = tmp_path / "fsdp.yaml"
    launch.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP",
                                      "mixed_precision": "bf16", "num_machines": 1, "num_processes": 1,
                                      "use_cpu": False, "fsdp_config": {"fsdp_state_dict_type": "FULL_STATE_DICT"}}))
    out = tmp_path / "out"
    result = run([*launcher_command("accelerate", config=launch), "--load_in_4bit", "--lora_r", "4",
                  "--output_dir", str(out), "--max_steps", "1"], timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("train.py: error:")]
    assert errors == [f"train.py: error: {qlora_refusals.sharding_refusal(1, {})}"], result.stderr[-3000:]
    assert "(exitcode: 2)" in result.stderr and not training_traceback_frames(result.stderr)  # accelerate's torchrun
    assert not out.exists()


@pytest.mark.parametrize(("sharded_precision", "storage"), [
    (None, "uint8"), ("bf16", "bfloat16"), ("fp16", "float16"), ("no", "float32")])
def test_quant_storage_matches_what_sharding_needs(sharded_precision, storage):
    config = quantization.bnb_config(sharded_precision)
    # transformers' own reading of the config (what from_pretrained passes to bitsandbytes)
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4" and config.bnb_4bit_use_double_quant
    assert config.bnb_4bit_compute_dtype == torch.bfloat16
    assert config.bnb_4bit_quant_storage == getattr(torch, storage)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("qlora") / "one"
    assert run_in_process([*COMMON, "--per_device_train_batch_size", "8", "--output_dir", str(out)]) == 0
    return out


def test_one_process_trains_an_adapter_on_a_4bit_base(one_process):
    import bitsandbytes as bnb
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    report = json.loads((one_process / "hf_scale_verify.json").read_text())
    assert report["ok"] and report["tensors_checked"] > 0
    adapter = load_file(one_process / "adapter_model.safetensors")
    assert adapter and all(t.numel() > 0 for t in adapter.values())
    assert all(t.abs().sum() > 0 for name, t in adapter.items() if "lora_B" in name)  # trained (B starts at 0)
    saved = json.loads((one_process / f"checkpoint-{STEPS}" / "config.json").read_text())["quantization_config"]
    assert saved["bnb_4bit_quant_type"] == "nf4" and saved["bnb_4bit_use_double_quant"] is True
    base = AutoModelForCausalLM.from_pretrained(
        EMBEDDED_MODEL_DIR, quantization_config=quantization.bnb_config())
    model = PeftModel.from_pretrained(base, str(one_process))
    assert isinstance(model.get_base_model().model.layers[0].mlp.up_proj.base_layer, bnb.nn.Linear4bit)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=PROBE_IDS).logits).all()


def test_a_qlora_checkpoint_resumed_without_load_in_4bit_is_refused_in_one_line(one_process, tmp_path, capfd):
    """The real checkpoint of a QLoRA run records its 4-bit base; resumed on a full-precision base (the flag left
    out) train.py refuses before anything loads, instead of continuing the adapter on weights it never saw."""
    saved = one_process / f"checkpoint-{STEPS}"
    assert json.loads((saved / "hf_scale_state.json").read_text())["quantization"] == "4bit"
    flags = [flag for flag in COMMON if flag != "--load_in_4bit"]
    out = tmp_path / "resumed"
    assert run_in_process([*flags, "--max_steps", str(STEPS + 1), "--per_device_train_batch_size", "8",
                           "--output_dir", str(out), "--resume_from_checkpoint", str(saved)]) == 2
    (line,) = [line for line in capfd.readouterr().err.splitlines() if "error" in line]
    assert line.startswith(f"train.py: error: --resume_from_checkpoint={saved}: saved on a 4-bit base "
                           "(--load_in_4bit), resumed on an unquantized base;")
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.multiprocess
def test_ddp_manual_loop_equals_one_process(one_process, tmp_path):
    out = tmp_path / "ddp"
    run_ok(torchrun(TRAIN_PY, *COMMON, "--per_device_train_batch_size", "4",
                    "--loop", "accelerate", "--output_dir", out), env=child_env())
    torch.testing.assert_close(losses(out), losses(one_process), rtol=LOSS_RTOL, atol=0)
    assert json.loads((out / "hf_scale_verify.json").read_text())["ok"]


@pytest.mark.multiprocess
def test_zero3_trainer_equals_one_process(one_process, tmp_path):
    """The 4-bit weights stored as bf16 (what ZeRO-3 flattens with the rest): DeepSpeed partitions and trains them
    on CPU. transformers loads a quantized model outside zero.Init, so each process reads the 4-bit base first."""
    configs = generate_config(tmp_path / "cfg", "z3", preset="zero3", sets=[
        "topology.processes_per_machine=2", "precision=bf16", "batch.micro_batch_size=4",
        "batch.gradient_accumulation_steps=1", "optimizer.lr=1e-3"])
    out = tmp_path / "z3"
    result = run_ok(torchrun(TRAIN_PY, *COMMON, "--per_device_train_batch_size", "4", "--output_dir", out,
                             "--deepspeed", configs / "ds_configs" / "z3.json"), env=child_env())
    assert "stored as bfloat16" in result.stderr
    torch.testing.assert_close(losses(out), losses(one_process), rtol=LOSS_RTOL, atol=0)
    adapter = load_file(out / "adapter_model.safetensors")  # ZeRO-3's classic failure: an empty adapter
    assert adapter and all(t.numel() > 0 for t in adapter.values())


@pytest.mark.multiprocess
def test_fsdp2_manual_loop_equals_one_process(one_process, tmp_path):
    """FSDP2 from a DistributedConfig (torch's fully_shard over gloo, as hf_scale shards on CPU): the packed 4-bit
    weights, stored as bf16, are sharded like any other parameter (each rank checkpoints half of every one) and
    bitsandbytes dequantizes the gathered weight with the quant_state kept on its Linear4bit module."""
    from torch.distributed.checkpoint import FileSystemReader

    config = tmp_path / "fsdp2.yaml"
    config.write_text("strategy: fsdp\nprecision: bf16\ntopology: {processes_per_machine: 2}\n"
                      "batch: {micro_batch_size: 4, gradient_accumulation_steps: 1}\noptimizer: {lr: 0.001}\n")
    out = tmp_path / "fsdp2"
    result = run_ok(torchrun(TRAIN_PY, *COMMON, "--per_device_train_batch_size", "4", "--loop", "accelerate",
                             "--hf_scale_config", config, "--output_dir", out), env=child_env())
    assert "stored as bfloat16" in result.stderr
    torch.testing.assert_close(losses(out), losses(one_process), rtol=LOSS_RTOL, atol=0)
    stored = FileSystemReader(str(out / f"checkpoint-{STEPS}" / DCP_DIR)).read_metadata().state_dict_metadata
    base = {k: v for k, v in stored.items() if k.startswith("model.") and k.endswith("base_layer.weight")}
    assert base and all(v.properties.dtype == torch.bfloat16 and len(v.chunks) == 2 for v in base.values())
    adapter = load_file(out / "adapter_model.safetensors")
    assert adapter.keys() == load_file(one_process / "adapter_model.safetensors").keys()
    assert all(t.numel() > 0 for t in adapter.values())
    # The checkpoint's adapter is only in the DCP shards (half per rank): `--merge` reads it there.
    _export_merged(out / f"checkpoint-{STEPS}", tmp_path / "merged", flag=["--merge"])
    _assert_merged_is_the_trained_model(tmp_path / "merged", out)


def _zero3_json(tmp_path):
    """The zero3 preset's DeepSpeed JSON for one process (as `hf-scale generate` writes it)."""
    from hf_scale.config.distributed_config import validate_config
    from hf_scale.contract.deepspeed_json import deepspeed_config

    cfg = validate_config({"strategy": "deepspeed", "deepspeed": {"zero_stage": 3}, "precision": "bf16",
                           "batch": {"micro_batch_size": 8, "gradient_accumulation_steps": 1}})
    path = tmp_path / "z3.json"
    path.write_text(json.dumps(deepspeed_config(cfg, "auto")))
    return path


@pytest.fixture(scope="module")
def manual_loop(tmp_path_factory):
    """The manual loop's checkpoint: accelerate's save_state (model.safetensors: the 4-bit base and the adapter),
    no adapter_model.safetensors."""
    out = tmp_path_factory.mktemp("qlora") / "manual"
    assert run_in_process([*COMMON, "--per_device_train_batch_size", "8", "--loop", "accelerate",
                           "--output_dir", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def zero3_manual_loop(tmp_path_factory):
    """ZeRO-3 (one process): the adapter is only in DeepSpeed's partitions."""
    tmp = tmp_path_factory.mktemp("qlora")
    out = tmp / "zero3"
    assert run_in_process([*COMMON, "--per_device_train_batch_size", "8", "--loop", "accelerate",
                           "--deepspeed", str(_zero3_json(tmp)), "--output_dir", str(out)]) == 0
    return out


def _export_merged(checkpoint, out, *, flag=("--lora", "merged")) -> None:
    from hf_scale.commands import cli

    try:
        code = cli.main(["export", str(checkpoint), str(out), *flag])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 0


def _assert_merged_is_the_trained_model(merged_dir, run_dir):
    """The merged bf16 model computes what the trained model (the 4-bit base + the run's final adapter) computes:
    within 0.02 on logits of magnitude ~1 (each merged weight rounded once to bf16, 2**-9 relative), while the same
    adapter merged into the unquantized base would be off by the quantization error (~0.1 here): so the merge used
    the 4-bit base, and the adapter the run trained."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert merged.dtype == torch.bfloat16 and "quantization_config" not in json.loads(
        (merged_dir / "config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, quantization_config=quantization.bnb_config())
    trained = PeftModel.from_pretrained(base, str(run_dir))
    unquantized = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR), str(run_dir))
    with torch.no_grad():
        want = trained(input_ids=PROBE_IDS).logits.float()
        got = merged(input_ids=PROBE_IDS).logits.float()
        off = unquantized(input_ids=PROBE_IDS).logits.float()
    torch.testing.assert_close(got, want, rtol=0, atol=0.02)
    assert (off - want).abs().max() > 5 * (got - want).abs().max()


def test_export_merged_matches_the_4bit_base_with_its_adapter(one_process, tmp_path):
    """The Trainer's checkpoint without DeepSpeed holds peft's adapter file only: the adapter is read from it."""
    _export_merged(one_process / f"checkpoint-{STEPS}", tmp_path / "merged")
    _assert_merged_is_the_trained_model(tmp_path / "merged", one_process)


def test_a_quiet_merge_prints_only_hf_scales_own_lines(one_process, tmp_path):
    """Every hf-scale command is quiet by default (hf_scale.quiet): the QLoRA merge's stderr holds only its own
    `hf-scale export:` lines, no progress bar (transformers' or its own) and no library notice (transformers'
    dequantize note, peft's FutureWarning). With --verbose they are all there: the filters are what keeps them out."""
    import subprocess
    import sys

    env = {k: v for k, v in child_env().items()
           if k not in ("HF_SCALE_VERBOSE", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY")}

    def merge(out, *extra):
        argv = [sys.executable, "-m", "hf_scale", "export", str(one_process / f"checkpoint-{STEPS}"), str(out),
                "--merge", *extra]
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    quiet = merge(tmp_path / "quiet")
    quiet_lines = quiet.stderr.splitlines()
    assert quiet_lines and all(line.startswith("hf-scale export: ") for line in quiet_lines), quiet_lines
    assert quiet.stdout == ""
    verbose = merge(tmp_path / "verbose", "--verbose").stderr
    for noise in ("Loading weights", "loading tensors", "Writing model shards", "The modules are dequantized in",
                  "is_gradient_checkpointing"):
        assert noise in verbose, noise


@pytest.mark.parametrize("run", ["manual_loop", "zero3_manual_loop"])
def test_export_merge_reads_the_adapter_from_the_checkpoints_own_weights(run, request, tmp_path):
    """The manual loop saves the adapter inside accelerate's model.safetensors (with the 4-bit base), ZeRO-3 in its
    partitions: `--merge` reads it there (hf_scale.export.checkpoint_readers) and gives the trained model."""
    from hf_scale.contract import checkpoint_layout

    run_dir = request.getfixturevalue(run)
    checkpoint = run_dir / f"checkpoint-{STEPS}"
    assert not (checkpoint / checkpoint_layout.ADAPTER_WEIGHTS).exists()
    assert checkpoint_layout.detect_layout(checkpoint).weights == {"manual_loop": checkpoint_layout.FULL,
                                                        "zero3_manual_loop": checkpoint_layout.DEEPSPEED}[run]
    _export_merged(checkpoint, tmp_path / "merged", flag=["--merge"])
    _assert_merged_is_the_trained_model(tmp_path / "merged", run_dir)


def test_an_empty_adapter_file_is_rescued_from_the_zero3_partitions(zero3_manual_loop, tmp_path):
    """ZeRO-3's classic failure, an adapter file whose tensors are empty, beside the partitions that hold the trained
    adapter: `--merge` reads the partitions and gives the trained model. The empty file is sealed into the manifest,
    as the saver that wrote it would have (a file the manifest does not list makes the checkpoint not intact)."""
    import json
    import shutil

    from safetensors.torch import save_file

    from hf_scale.commands.export import export
    from hf_scale.contract.checkpoint_integrity import HASH_NAME, file_digest
    from hf_scale.contract.checkpoint_layout import MANIFEST

    checkpoint = tmp_path / f"checkpoint-{STEPS}"
    shutil.copytree(zero3_manual_loop / f"checkpoint-{STEPS}", checkpoint)
    planted = checkpoint / "adapter_model.safetensors"
    save_file({"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.empty(0)}, planted)
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"][planted.name] = {"size": planted.stat().st_size, HASH_NAME: file_digest(planted)}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    export(checkpoint, tmp_path / "merged", lora="merged", verify=False)
    _assert_merged_is_the_trained_model(tmp_path / "merged", zero3_manual_loop)
