"""The planner counts a 4-bit base and recommends QLoRA where neither a full nor a LoRA fine-tune fits:
Llama-3.1-70B on 2 x 80 GiB. The expectations are derived from the model's shapes (parameter counts measured on
the meta device), not read back from the planner; `plan --json` and `generate --strategy auto --recipe` carry the
choice to train.py's flags."""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from train_helpers import run_ok
from transformers import LlamaConfig

from hf_scale.planner import Workload, make_plan, model_shapes
from hf_scale.planner.rank import with_qlora_fallback

GIB = 2**30
# Llama-3.1-70B's config.json (the shapes that matter).
LLAMA_31_70B = dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                    intermediate_size=28672, vocab_size=128256, max_position_embeddings=131072)
SEQ, GPUS, GPU_MEMORY, CPU_MEMORY, MARGIN = 8192, 2, 80 * GIB, 128 * GIB, 0.1


@pytest.fixture(scope="module")
def shapes():
    return model_shapes(LlamaConfig(**LLAMA_31_70B), name="Llama-3.1-70B")


def _plan(shapes, **tuning):
    budget = {"gpu_memory": GPU_MEMORY, "cpu_memory": CPU_MEMORY, "safety_margin": MARGIN}
    w = Workload(shapes, gpus_per_machine=GPUS, num_machines=1, seq_len=SEQ, micro_batch_size=1, **tuning)
    return with_qlora_fallback(make_plan(w, **budget), **budget)


def test_llama_70b_on_2x80gib_gets_qlora(shapes):
    usable_gpu, usable_cpu = GPU_MEMORY * (1 - MARGIN), CPU_MEMORY * (1 - MARGIN)
    bf16_base = 2 * shapes.total_params
    logits = SEQ * shapes.vocab_size * (2 + 4 + 4)  # bf16 logits, their fp32 upcast, fp32 log-softmax
    # A LoRA fine-tune must hold the bf16 base: sharded over both GPUs it leaves no room for one sequence's loss,
    # and offloaded it does not fit the CPU RAM. A full fine-tune needs far more (16 bytes per parameter).
    assert bf16_base / GPUS + logits > usable_gpu and bf16_base > usable_cpu
    # The 4-bit base: the decoder layers' linear weights at NF4 with double quantization, the rest in bf16.
    assert 0.9 * shapes.total_params < shapes.linear_params < shapes.total_params
    nf4_base = shapes.linear_params * (0.5 + 1 / 64) + 2 * (shapes.total_params - shapes.linear_params)
    assert nf4_base + logits < usable_gpu / 1.4  # fits on one GPU with room for activations

    for tuning in ({}, {"lora_r": 16}):
        plan = _plan(shapes, **tuning)
        assert plan.workload.load_in_4bit and plan.workload.lora_r == 16
        assert plan.recommended is not None and plan.qlora_because.startswith(
            "a LoRA (r=16) fine-tune" if tuning else "a full fine-tune")
        # The planner's count of the 4-bit base agrees with the shapes' (NF4 scales of the second level aside).
        ddp = next(a for a in plan.assessments if a.candidate.engine == "ddp")
        trainable = 16 * shapes.lora_params_per_rank
        assert ddp.estimate.params - 4 * trainable == pytest.approx(nf4_base, rel=1e-3)


def test_an_explicit_4bit_plan_needs_lora(tmp_path):
    from hf_scale.commands.cli import main

    LlamaConfig(**LLAMA_31_70B).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(tmp_path), "--load-in-4bit"])
    assert exit_.value.code == 2


def test_plan_json_and_generate_carry_qlora_to_train_flags(tmp_path):
    model = tmp_path / "llama70b"
    LlamaConfig(**LLAMA_31_70B).save_pretrained(model)
    flags = ["--gpus-per-machine", "2", "--gpu-memory", "80GiB", "--cpu-memory", "128GiB", "--seq-len", str(SEQ)]
    planned = run_ok([sys.executable, "-m", "hf_scale", "plan", str(model), *flags, "--json"])
    data = json.loads(planned.stdout)
    assert data["workload"]["load_in_4bit"] is True and data["qlora_because"]
    assert data["train_flags"] == {"max_seq_length": SEQ, "lora_r": 16, "load_in_4bit": True}
    run_ok([sys.executable, "-m", "hf_scale", "generate", "--strategy", "auto", "--model", str(model), *flags,
            "--recipe", "--name", "q", "--output-dir", str(tmp_path / "out")])
    recipe = yaml.safe_load((tmp_path / "out" / "recipes" / "q.yaml").read_text())
    assert recipe["lora_r"] == 16 and recipe["load_in_4bit"] is True and recipe["max_seq_length"] == SEQ
    # train.py reads the recipe as it does at start (its recipe expansion and parser)
    from hf_scale.contract.parser import build_parser
    from hf_scale.contract.recipe import expand_recipe

    parser = build_parser()
    argv, _ = expand_recipe(parser, [str(tmp_path / "out" / "recipes" / "q.yaml")])
    ns, unknown = parser.parse_known_args(argv)
    assert not unknown and ns.load_in_4bit is True and ns.lora_r == 16 and ns.max_seq_length == SEQ
