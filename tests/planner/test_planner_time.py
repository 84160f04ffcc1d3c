"""The time model (hf_scale/planner/time_model.py) against published runs, its physics term by term, the GPU
profiles, and `plan --gpu/--tokens/--price-per-gpu-hour` through the real CLI."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from transformers import LlamaConfig

from hf_scale.commands.cli import main
from hf_scale.planner import Candidate, Workload, model_shapes
from hf_scale.planner.hardware import efficiencies, gpu_names, hardware
from hf_scale.planner.published import accuracy, compare, excluded, fit, leave_one_source_out, rows, source
from hf_scale.planner.rank import TIE
from hf_scale.planner.time_model import step_time

LLAMA = {
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256),
    "70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                intermediate_size=28672, vocab_size=128256),
}  # fmt: skip
FSDP = Candidate("fsdp2_full_shard", "FSDP2 full shard", "fsdp")
HYBRID = Candidate("fsdp2_hybrid_multinode", "FSDP2 hybrid shard", "fsdp", hybrid=True)
ZERO3_OFFLOAD = Candidate(
    "zero3_offload_opt", "ZeRO-3 + opt offload", "deepspeed", zero_stage=3, offload_optimizer=True
)
# Where the accuracy stands (median absolute error 7.4%, 69 of 70 rows within +-25%): it may improve, never regress.
# (7.3% over 69 rows before FlagPerf's ZeRO-3 row on 8 A800, predicted +8.6%, moved the median.)
MEDIAN_ERROR_AT_MOST = 0.075
WITHIN_25_AT_LEAST = 0.985
# Out of sample (each source predicted with efficiencies fitted to the others): median 7.7%, 69 of 70 within +-25%.
HELD_OUT_MEDIAN_AT_MOST = 0.077
HELD_OUT_WITHIN_25_AT_LEAST = 0.985
# LoRA/QLoRA rows (NeMo AutoModel, torchtune), held out: every one within 12% (the worst: torchtune's QLoRA on one
# RTX 4090, -11.8%; the NeMo rows alone were within 10%).
LORA_HELD_OUT_ERROR_AT_MOST = 0.12


@pytest.fixture(scope="module")
def shapes():
    return {name: model_shapes(LlamaConfig(**config), name=name) for name, config in LLAMA.items()}


def work(shapes, name="8b", machines=1, seq_len=8192, **kw):
    return Workload(shapes[name], gpus_per_machine=8, num_machines=machines, seq_len=seq_len, micro_batch_size=1, **kw)


def test_every_published_run_is_predicted_within_the_accuracy_reached():
    comparisons = compare()
    assert len(comparisons) >= 50
    assert len({c.row["source"] for c in comparisons}) >= 5
    for c in comparisons:
        assert source(c.row["source"]) and c.row["where"]
    median, within = accuracy(comparisons)
    assert median <= MEDIAN_ERROR_AT_MOST, median
    assert within >= WITHIN_25_AT_LEAST, within


def test_the_rows_cover_zero3_tp_cp_fp8_compile_lora_qlora_and_offload():
    runs = rows()
    assert {r["layout"] for r in runs} >= {"fsdp_full_shard", "zero3"}
    assert any(r["layout"] == "zero3" and r["recompute"] == "none" for r in runs)  # ZeRO-3 gathers not hidden by AC
    for option in ("tp", "cp", "fp8", "fp8_all_gather", "compile", "lora_r", "qlora", "offload_params"):
        assert any(r.get(option) for r in runs), option
    assert any(r.get("lora_r") and r["gpus"] == 1 for r in runs)  # a single-GPU LoRA fine-tune
    assert {"a100-80gb", "a800", "h100-sxm", "h200", "rtx4090"} <= {r["gpu"] for r in runs}


def test_rows_left_out_of_the_accuracy_say_why_and_are_still_predicted():
    """A row kept out of the fit and the accuracies (HSDP on a network its source does not state, a row whose
    throughput its stated settings cannot reach, packed rows whose fill is not stated) carries its reason, and is
    predicted all the same."""
    left_out = excluded()
    assert {c.row["layout"] for c in left_out} == {"hsdp", "fsdp_full_shard", "zero2", "zero3"}
    for c in left_out:
        assert source(c.row["source"]) and c.row["where"] and len(c.row["excluded"]) > 40
        assert c.predicted > 0 and c.row not in rows()


def test_lora_fine_tunes_held_out_are_predicted_within_ten_percent():
    """The LoRA rows (a frozen base: no weight gradients, 4 N FLOPs per token) predicted with efficiencies fitted to
    the other sources only, one GPU and FSDP2 x TP on 8 and 16 GPUs."""
    lora = [c for group in leave_one_source_out().values() for c in group if c.row.get("lora_r")]
    assert len(lora) >= 6 and any(c.row["gpus"] == 1 for c in lora)
    assert max(abs(c.error) for c in lora) <= LORA_HELD_OUT_ERROR_AT_MOST, [round(c.error, 3) for c in lora]


def test_the_data_files_efficiencies_are_the_fit_of_every_published_row():
    """hardware.yaml's efficiencies are not tuned by hand: they are what fit() finds on all rows."""
    fitted = fit(range(len(rows())))
    assert {arch: efficiencies()[arch] for arch in fitted} == fitted


def test_each_source_held_out_is_predicted_within_the_accuracy_reached():
    """Leave one source out: fit the efficiencies on the other sources, predict the held-out one."""
    held_out = leave_one_source_out()
    assert len(held_out) >= 5
    median, within = accuracy([c for comparisons in held_out.values() for c in comparisons])
    assert median <= HELD_OUT_MEDIAN_AT_MOST, median
    assert within >= HELD_OUT_WITHIN_25_AT_LEAST, within


def test_the_predicted_order_matches_where_a_source_compares_compile_and_float8():
    """torchtitan's H100 tables 1 and 3: FSDP < FSDP + compile < FSDP + compile + Float8, on 8 and on 128 GPUs."""
    comparisons = [c for c in compare() if c.row["source"] == "torchtitan-h100" and c.row["where"][:7] in
                   ("Table 1", "Table 3")]  # fmt: skip
    for table in ("Table 1", "Table 3"):
        mine = sorted((c for c in comparisons if c.row["where"].startswith(table)), key=lambda c: c.published)
        assert len(mine) == 3
        predicted = [c.predicted for c in mine]
        assert all(a < b for a, b in zip(predicted, predicted[1:], strict=False)), (table, predicted)


def test_the_predicted_order_matches_where_a_source_compares_one_and_two_machines():
    """NeMo AutoModel's LoRA table: the same FSDP2 x TP2 fine-tune on 16 GPUs trains fewer tokens/s per GPU than on 8
    (the sharding groups cross the network), for Llama-3-70B and Qwen2.5-32B."""
    for model in ("llama3-70b", "qwen2.5-32b"):
        mine = {c.row["gpus"]: c for c in compare() if c.row["source"] == "nemo-automodel-h100"
                and c.row["model"] == model and c.row.get("lora_r")}  # fmt: skip
        assert mine[8].published > mine[16].published
        assert mine[8].predicted > mine[16].predicted, (model, mine[8].predicted, mine[16].predicted)


def test_the_predicted_order_matches_where_a_source_compares_zero2_and_zero3():
    """ms-swift's Qwen2.5-14B full fine-tune on one machine of 8 A800, the same packed data under DeepSpeed ZeRO-2 and
    ZeRO-3 (kept out of the accuracy: published_runs.yaml says why): ZeRO-2 is faster (10.32 vs 10.56 s/it), and so is
    the prediction, which holds only while time_model.OVERLAP hides at most ~75% of DeepSpeed's communication. Both
    stay within 20% of the published upper bound (now -15% and -14%)."""
    pair = {c.row["layout"]: c for c in excluded() if c.row["source"] == "ms-swift-a800"}
    assert pair["zero2"].published > pair["zero3"].published
    assert pair["zero2"].predicted > pair["zero3"].predicted, (pair["zero2"].predicted, pair["zero3"].predicted)
    assert all(abs(c.error) <= 0.20 for c in pair.values()), [round(c.error, 3) for c in pair.values()]


def test_activation_checkpointing_costs_about_one_forward(shapes):
    w, h100 = work(shapes), hardware("h100-sxm")
    off = step_time(w, FSDP, h100)
    on = step_time(w, replace(FSDP, activation_checkpointing=True), h100)
    assert 1.2 < on.compute_s / off.compute_s < 1.4  # backward is ~2 forwards: recomputing one adds ~1/3
    assert on.mfu < off.mfu  # MFU counts the model's FLOPs, not the recomputed ones


def test_longer_sequences_spend_more_per_token_on_attention(shapes):
    h100 = hardware("h100-sxm")
    short, long = (step_time(work(shapes, seq_len=n), FSDP, h100) for n in (2048, 32768))
    assert long.tokens_per_s < 0.8 * short.tokens_per_s


def test_sharding_across_machines_pays_the_network_and_hybrid_pays_it_once(shapes):
    """Full sharding gathers over the network three times per micro-batch; hybrid gathers over NVLink and all-reduces
    its gradient shards across machines once: on a network slower than NVLink (100 Gb/s per GPU) it communicates
    less, and sharding over two machines costs more than over one."""
    h100 = replace(hardware("h100-sxm"), inter_node_bps=12.5e9)
    w = work(shapes, "70b", machines=2)
    full, hybrid = step_time(w, FSDP, h100), step_time(w, HYBRID, h100)
    assert full.communication_total_s > 1.5 * hybrid.communication_total_s
    one = step_time(work(shapes, "70b"), FSDP, h100)
    assert full.communication_total_s > 2 * one.communication_total_s


def test_cpu_offload_grows_with_the_parameters_and_bounds_the_step(shapes):
    h100 = hardware("h100-sxm")
    small, large = (step_time(work(shapes, name), ZERO3_OFFLOAD, h100) for name in ("8b", "70b"))
    ratio = shapes["70b"].total_params / shapes["8b"].total_params
    assert large.offload_s / small.offload_s == pytest.approx(ratio, rel=0.01)
    assert large.dominant == "offload" and large.optimizer_s == 0


def test_tensor_parallel_communication_grows_with_the_degree(shapes):
    """World size = TP degree: no FSDP sharding left, only the activation all-reduces, which grow as (tp-1)/tp."""
    h100 = hardware("h100-sxm")
    comm = []
    for tp in (2, 4, 8):
        w = Workload(shapes["8b"], gpus_per_machine=tp, num_machines=1, seq_len=8192, micro_batch_size=1)
        comm.append(step_time(w, replace(FSDP, tp=tp), h100).communication_total_s)
    assert comm == sorted(comm) and comm[0] > 0


def test_lora_computes_no_weight_gradients(shapes):
    h100 = hardware("h100-sxm")
    full, lora = step_time(work(shapes), FSDP, h100), step_time(work(shapes, lora_r=16), FSDP, h100)
    assert 0.6 < lora.compute_s / full.compute_s < 0.9


def test_every_profile_is_complete_and_faster_gpus_predict_more(shapes):
    w = work(shapes, seq_len=4096)
    speed = {}
    for name in gpu_names():
        hw = hardware(name)
        assert hw.bf16_flops > 0 and hw.hbm_bps > 0 and hw.inter_node_bps > 0 and "NVIDIA" in hw.source
        speed[name] = step_time(w, FSDP, hw).tokens_per_s
    assert speed["b200"] > speed["h100-sxm"] > speed["a100-80gb"] > speed["l40s"] > speed["a10g"]
    assert hardware("H100_SXM") == hardware("h100-sxm")


def test_plan_takes_a_gpu_and_a_token_budget(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", **LLAMA["8b"]}))
    argv = [
        "plan",
        str(config),
        "--gpu",
        "a100-40gb",
        "--seq-len",
        "4096",
        "--tokens",
        "1e9",
        "--price-per-gpu-hour",
        "2",
    ]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["workload"]["gpu"] == "a100-40gb" and data["workload"]["gpu_memory_bytes"] == 40 * 2**30
    best = next(c for c in data["candidates"] if c["key"] == data["recommended"])
    t = best["time"]
    assert t["step_s"] == pytest.approx(t["compute_s"] + t["communication_s"] + t["optimizer_s"] + t["offload_s"])
    assert t["run"]["hours"] == pytest.approx(1e9 / (t["tokens_per_s_per_gpu"] * 8) / 3600)
    assert t["run"]["cost"] == pytest.approx(2 * t["run"]["gpu_hours"])
    speeds = [c["time"]["tokens_per_s_per_gpu"] for c in data["candidates"]]
    assert all(a >= b / (1 + TIE) ** 2 for a, b in zip(speeds, speeds[1:], strict=False))  # fastest first
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "on A100 SXM 40GB" in out and "tokens: " in out and "GPU-hours, cost " in out


@pytest.mark.parametrize(("model", "gpus", "seq_len"), [
    ("8b", 8, 8192), ("70b", 8, 8192), ("70b", 16, 8192), ("70b", 64, 8192), ("70b", 64, 32768),
])  # fmt: skip
def test_the_issues_scenarios_name_a_recommendation_its_time_and_why_the_others_lose(model, gpus, seq_len, tmp_path,
                                                                                      capsys):
    """Llama-3.1-8B on 8 x H100 at 8k, Llama-3.1-70B on 8/16/64 H100 at 8k and 32k: the plan names the fastest layout
    that fits with its predicted step, tokens/s, MFU and wall-clock; every faster layout it rejects, with the memory it
    needs; every slower one that fits, with the term its step spends most on."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", **LLAMA[model]}))
    argv = ["plan", str(config), "--gpu", "h100-sxm", "--gpus-per-machine", "8", "--num-machines", str(gpus // 8),
            "--seq-len", str(seq_len), "--tokens", "1e9"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    best = next(c for c in data["candidates"] if c["key"] == data["recommended"])
    assert best["fits"] and best["time"]["step_s"] > 0 and best["time"]["run"]["hours"] > 0
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"({best['key']}):" in next(line for line in out.splitlines() if line.startswith("recommended: "))
    predicted = next(line for line in out.splitlines() if line.strip().startswith("predicted:"))
    assert all(word in predicted for word in ("s/step", "tokens/s per GPU", "MFU", "wall-clock")), predicted
    speed = best["time"]["tokens_per_s_per_gpu"]
    faster = [c for c in data["candidates"] if c["time"]["tokens_per_s_per_gpu"] > speed]
    assert faster and all(not c["fits"] for c in faster)  # the recommendation is the fastest that fits
    rejected = out.split("faster candidates rejected:\n")[1].split("slower candidates")[0].split("pass to")[0]
    lines = [line for line in rejected.splitlines() if line.startswith("  ")]
    assert len(lines) == len(faster) and all(" needs " in line and " GiB per GPU > " in line for line in lines), out
    if any(c["fits"] and c["key"] != best["key"] for c in data["candidates"]):
        why = out.split("slower candidates that fit (what their step spends most on):\n")[1]
        first = why.splitlines()[0]
        assert "tokens/s per GPU" in first and any(f", {term} (" in first for term in (
            "compute", "communication", "offload", "optimizer")), first


@pytest.mark.parametrize(("flags", "fragment"), [
    (["--gpu", "h300"], "--gpu 'h300' is not a known GPU: allowed h100-sxm, "),
    (["--tokens", "-5"], "--tokens -5 is invalid: allowed a positive number"),
    (["--tokens", "inf"], "--tokens inf is invalid"),
    (["--price-per-gpu-hour", "2"], "--price-per-gpu-hour 2.0 needs --tokens N"),
    (["--tokens", "1e9", "--price-per-gpu-hour", "-1"], "--price-per-gpu-hour -1.0 is invalid"),
])  # fmt: skip
def test_bad_gpu_or_budget_is_one_line_exit_2_and_writes_nothing(flags, fragment, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", **LLAMA["8b"]}))
    written = tmp_path / "plan.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", str(config), *flags, "--write-config", str(written)])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and fragment in lines[0], lines
    assert not written.exists()
