"""The plan's sequence length, from `--seq-len` to the run: CP candidates at the length train.py's CP collator pads
to, a warning past the model's max_position_embeddings, and the train.py flag that carries the length (the
DistributedConfig has no field for it) in the plan's last lines, the written config and the generated recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from transformers import LlamaConfig

from hf_scale.commands.cli import main
from hf_scale.planner import Candidate, Workload, estimate, make_plan, model_shapes

GIB = 2**30
LLAMA_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072)
FLAGS = ["--gpus-per-machine", "8", "--gpu-memory", "80GiB"]


@pytest.fixture
def llama8b(tmp_path) -> str:
    """A directory holding a Llama-3.1-8B-like config.json."""
    (tmp_path / "llama8b").mkdir()
    (tmp_path / "llama8b" / "config.json").write_text(json.dumps({"model_type": "llama", **LLAMA_8B}))
    return str(tmp_path / "llama8b")


def _workload(seq_len: int) -> Workload:
    return Workload(model_shapes(LlamaConfig(**LLAMA_8B), name="m"), gpus_per_machine=8, num_machines=1,
                    seq_len=seq_len, micro_batch_size=1)


def test_a_length_that_is_no_multiple_of_2_x_cp_plans_cp_at_the_padded_length():
    """train.py's CP collator pads each batch to a multiple of 2 x cp: 131071 tokens train as 131072, so every CP
    candidate is offered and costs exactly what it costs at 131072 (one token short of it is no reason to drop it)."""
    odd, even = _workload(131071), _workload(131072)
    assert [odd.cp_seq_len(cp) for cp in (1, 2, 4, 8)] == [131071, 131072, 131072, 131072]
    assert _workload(4097).cp_seq_len(4) == 4104
    for cp in (2, 4, 8):
        candidate = Candidate(f"fsdp2_cp{cp}", "", "fsdp", cp=cp, activation_checkpointing=True)
        assert estimate(odd, candidate) == estimate(even, candidate)
    plan = make_plan(odd, gpu_memory=80 * GIB)
    assert {a.candidate.cp for a in plan.assessments} == {1, 2, 4, 8}
    best = make_plan(even, gpu_memory=80 * GIB).recommended
    assert plan.recommended.slug == best.slug and plan.recommended.candidate.cp > 1
    assert plan.recommended.estimate.gpu_total == best.estimate.gpu_total


def test_the_cli_recommends_cp_at_an_odd_length_and_says_it_pads(llama8b, capsys):
    assert main(["plan", llama8b, *FLAGS, "--seq-len", "131071"]) == 0
    out = capsys.readouterr().out
    assert "CP rows are planned at the length train.py pads 131071 tokens to" in out
    assert "CP=4 at 131072" in out
    assert "recommended: FSDP2 x CP=" in out and "(sequences padded to 131072 tokens for CP)" in out
    assert main(["plan", llama8b, *FLAGS, "--seq-len", "131071", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    lengths = {c["parallelism"]["cp"]: c["seq_len"] for c in payload["candidates"]}
    assert lengths == {1: 131071, 2: 131072, 4: 131072, 8: 131072}


def test_a_length_past_max_position_embeddings_is_warned_in_one_line(llama8b, capsys):
    assert main(["plan", llama8b, *FLAGS, "--seq-len", "131072"]) == 0
    assert capsys.readouterr().err == ""
    main(["plan", llama8b, *FLAGS, "--seq-len", "262144", "--json"])
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("hf-scale: warning: --seq-len 262144 is beyond the model's max_position_embeddings 131072")
    assert "not trained on sequences that long" in line and "rope_scaling" in line
    assert json.loads(captured.out)["warnings"] == [line.removeprefix("hf-scale: warning: ")]


def test_the_length_reaches_train_py_through_the_last_lines_the_written_config_and_the_recipe(llama8b, tmp_path,
                                                                                            capsys):
    config = tmp_path / "plan.yaml"
    assert main(["plan", llama8b, *FLAGS, "--seq-len", "16384", "--lora-r", "8", "--write-config", str(config)]) == 0
    out = capsys.readouterr().out
    flags = "--max_seq_length 16384 --lora_r 8"
    assert f"pass to train.py (no config field holds them): {flags}\n" in out
    text = config.read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert any(line.endswith(flags) for line in header), header
    assert "--seq-len 16384" in header[0]
    assert yaml.safe_load(text)["strategy"]  # still the config, comments aside
    out_dir = tmp_path / "gen"
    assert main(["generate", "--strategy", "auto", "--model", llama8b, *FLAGS, "--seq-len", "16384", "--recipe",
                 "--output-dir", str(out_dir)]) == 0
    assert "pass to train.py (no config field holds them): --max_seq_length 16384" in capsys.readouterr().out
    (recipe,) = Path(out_dir / "recipes").glob("*.yaml")
    assert yaml.safe_load(recipe.read_text())["max_seq_length"] == 16384


def test_write_config_replaces_a_different_file_only_with_force(llama8b, tmp_path, capsys):
    config = tmp_path / "plan.yaml"
    config.write_text("# my edits\nstrategy: ddp\n")
    with pytest.raises(SystemExit) as exited:
        main(["plan", llama8b, *FLAGS, "--write-config", str(config)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1
    assert f"--write-config {config} exists with different content; pass --force to replace it" in err
    assert config.read_text() == "# my edits\nstrategy: ddp\n"
    assert main(["plan", llama8b, *FLAGS, "--write-config", str(config), "--force"]) == 0
    planned = config.read_text()
    assert planned.startswith("# hf-scale plan:")
    assert main(["plan", llama8b, *FLAGS, "--write-config", str(config)]) == 0  # the same content: no --force needed
    assert config.read_text() == planned


def test_plan_help_names_the_tp_and_cp_candidates(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "FSDP2 x TP and FSDP2 x CP (sizes 2, 4, 8" in text and "HSDP x TP" in text
