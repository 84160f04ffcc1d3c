"""The configs users already have: a corpus of accelerate YAMLs and DeepSpeed JSONs from public projects
(tests/data/peer_configs; its index.yaml says, per file, the repository, path and commit it was copied from,
verbatim or with the edits listed, or that it was written in a project's shape).

`hf-scale check` must report exactly the findings listed for every case (no crash, nothing wrong, nothing
missed), and train.py must accept the YAMLs whose DeepSpeed settings sit inline under `deepspeed_config`:
accelerate's own launch code computes the environment `accelerate launch` would give the training
processes, and train.py's own functions turn it into the DeepSpeed config it trains with, in-process. Two
of them really train in tests/train/loops/test_loops_equivalence.py.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import types
from pathlib import Path

import pytest
import yaml
from paths import REPO, TEST_DATA

from hf_scale.commands import check
from hf_scale.commands.cli import main
from hf_scale.contract import inline_deepspeed
from hf_scale.contract.config_flags import filled
from hf_scale.contract.parser import build_parser
from hf_scale.errors import UserError
from hf_scale.knowledge.rules import given_flags
from hf_scale.train.setup import distributed

CORPUS = TEST_DATA / "peer_configs"
CASES = yaml.safe_load((CORPUS / "index.yaml").read_text())["cases"]


def _check_argv(case: dict) -> list[str]:
    """`hf-scale check FILE...` as a user types it: the files positionally (recognized by their content), a job
    manifest with --manifest."""
    argv = ["check", "--json", *[case[key] for key in ("accelerate", "deepspeed") if case.get(key)]]
    if case.get("manifest"):
        argv += ["--manifest", case["manifest"]]
    if case.get("runner"):
        argv += ["--runner", case["runner"]]
    if case.get("gpus") is not None:
        argv += ["--gpus-per-machine", str(case["gpus"])]
    return argv + ["--", *case.get("training_args", [])]


REFUSED = [case for case in CASES if case.get("refused")]


@pytest.mark.parametrize("case", REFUSED, ids=[case["name"] for case in REFUSED])
def test_a_file_check_does_not_read_is_one_line_saying_what_it_is(case, monkeypatch, capsys):
    """Other projects' training recipes: said what they are, not called a DeepSpeed config that is not JSON."""
    monkeypatch.chdir(CORPUS)
    try:
        code = main(["check", case["refused"]["file"]])
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert case["refused"]["says"] in err, err


CHECKED = [case for case in CASES if not case.get("refused")]


@pytest.mark.parametrize("case", CHECKED, ids=[case["name"] for case in CHECKED])
def test_check_reports_exactly_the_expected_findings(case, monkeypatch, capsys):
    monkeypatch.chdir(CORPUS)
    try:
        code = main(_check_argv(case))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    assert code in (0, 1), err
    payload = json.loads(out)
    found = sorted(f"{f['severity']} {f['code']} {f['where']}" for f in payload["findings"])
    assert found == sorted(case["expected"])
    assert code == (1 if any(f["severity"] == "error" for f in payload["findings"]) else 0)
    for finding in payload["findings"]:
        fix, file = finding["fix"], finding["file"]
        assert Path(file).name in fix or (file == check.TRAINING_ARGS and "--" in fix), finding


def test_every_corpus_file_is_used_and_every_case_says_where_it_comes_from():
    used = {case[key] for case in CASES for key in ("accelerate", "deepspeed", "manifest") if case.get(key)}
    used |= {case["refused"]["file"] for case in CASES if case.get("refused")}
    used |= {arg for case in CASES for arg in case.get("training_args", []) if arg.endswith(".json")}
    for case in CASES:
        text = (CORPUS / case["accelerate"]).read_text() if case.get("accelerate") else "{}"
        used |= set(filter(None, [yaml.safe_load(text).get("deepspeed_config", {}).get("deepspeed_config_file")]))
        assert case["origin"].strip() and case["exercises"].strip(), case["name"]
    files = {p.name for p in CORPUS.iterdir() if p.suffix in (".yaml", ".json") and p.name != "index.yaml"}
    assert files == used


FILES = yaml.safe_load((CORPUS / "index.yaml").read_text())["files"]


def _git_blob(data: bytes) -> str:
    """`git hash-object`: the blob id GitHub shows for the file at its commit."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.mark.parametrize("name", sorted(FILES))
def test_every_copy_is_the_public_file_byte_for_byte_or_with_its_listed_edits(name):
    entry, data = FILES[name], (CORPUS / name).read_bytes()
    assert entry["copy"] in ("verbatim", "edited", "written"), name
    if entry["copy"] == "written":
        assert entry["origin"].strip()
        return
    assert entry["repo"].count("/") == 1 and len(entry["commit"]) == 40 and entry["license"] == "Apache-2.0"
    if entry["copy"] == "edited":
        assert entry["reason"].strip() and entry["edits"]
        text = data.decode()
        for before, after in entry["edits"]:
            assert text.count(after) == 1, (name, after)
            text = text.replace(after, before)
        data = text.encode()
    assert _git_blob(data) == entry["blob"], name


def test_the_corpus_files_are_those_the_index_describes():
    on_disk = {p.name for p in CORPUS.iterdir() if p.suffix in (".yaml", ".json") and p.name != "index.yaml"}
    assert on_disk == set(FILES)


# Issue 21's classes, each answered on a public file copied verbatim (num_processes auto: no standalone public file
# was found, so its case runs TRL's file with that one value edited; index.yaml says so).
ISSUE_21_CLASSES = {
    "optimizer offload keeps lr/betas/eps/weight_decay": ["handbook-zero3-offload-inline"],
    "offload replaces a non-Adam --optim": [
        "handbook-zero3-offload-inline-adafactor",
        "llamafactory-deepspeed-multinode-sgd",
    ],
    "precision block beside zero_optimization": ["deepspeedexamples-bf16-master-weights"],
    "mixed_precision 'no' with --bf16": [
        "trl-ddp-mixed-precision-no-with-bf16",
        "trl-zero2-inline-mixed-precision-no-with-bf16",
    ],
    "DeepSpeed JSON without gradient_accumulation_steps": ["deepspeedexamples-cifar-accumulation-flag"],
    "autotuning.enabled": ["deepspeedexamples-autotuning-under-the-trainer"],
    "FSDP SHARDED_STATE_DICT final save": ["trl-fsdp2-plain-trainer-script", "handbook-fsdp1"],
    "warmup and WarmupLR messages": ["deepspeedexamples-cifar-under-the-trainer", "accelerate-tests-zero2-offload"],
}


@pytest.mark.parametrize("kind", sorted(ISSUE_21_CLASSES))
def test_each_issue_21_class_is_checked_on_a_verbatim_public_file(kind):
    by_name = {case["name"]: case for case in CASES}
    for name in ISSUE_21_CLASSES[kind]:
        case = by_name[name]
        used = [case.get("accelerate"), case.get("deepspeed")] + [
            a for a in case.get("training_args", []) if a.endswith(".json")
        ]
        if case.get("accelerate"):  # the JSON an accelerate YAML names
            named = yaml.safe_load((CORPUS / case["accelerate"]).read_text()).get("deepspeed_config", {})
            used.append(named.get("deepspeed_config_file"))
        assert any(FILES[f]["copy"] == "verbatim" for f in used if f), (kind, name)


# ---- train.py accepts the inline-DeepSpeed YAMLs (in-process) -----------------------------------------------


def _launch_environment(monkeypatch, yaml_file: Path, training_args: list[str]) -> check.CheckInputs:
    """Put the ACCELERATE_* variables `accelerate launch` would set for this YAML into os.environ."""
    inputs = check.load_inputs(str(yaml_file), training_args=training_args)
    assert inputs.launch_env is not None, inputs.launch_error
    for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        monkeypatch.delenv(key)
    for key, value in inputs.launch_env.items():
        if key.startswith("ACCELERATE_"):
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("WORLD_SIZE", str(inputs.accelerate["num_processes"]))
    return inputs


TRAINABLE = [case for case in CASES if case.get("train")]


@pytest.mark.parametrize("case", TRAINABLE, ids=[case["name"] for case in TRAINABLE])
def test_train_py_accepts_the_inline_deepspeed_yaml_and_agrees_with_check(case, monkeypatch):
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    training_args = case.get("training_args", [])
    inputs = _launch_environment(monkeypatch, CORPUS / case["accelerate"], training_args)
    section = inputs.accelerate["deepspeed_config"]

    request = distributed.detect_launch(None)
    assert (request.strategy, request.launcher) == ("deepspeed", "accelerate")
    assert request.zero_stage == section["zero_stage"] == inputs.inline_deepspeed["zero_optimization"]["stage"]
    ns, _ = build_parser().parse_known_args(training_args)
    from_yaml = inline_deepspeed.apply_to_flags(request.deepspeed_inline, ns, given_flags(training_args, vars(ns)))
    config, ns = from_yaml.deepspeed, filled(ns, from_yaml.fills)

    # What check reads from the file is what train.py trains with: stage, offload, precision, accumulation.
    assert config == inputs.inline_deepspeed
    assert ns.gradient_accumulation_steps == section.get("gradient_accumulation_steps", 1)
    precision = inputs.accelerate["mixed_precision"]
    assert (ns.bf16, ns.fp16) == (precision == "bf16", precision == "fp16")
    assert config["zero_optimization"]["offload_optimizer"]["device"] == section.get("offload_optimizer_device", "none")
    if section["zero_stage"] == 3:
        assert request.deepspeed_inline.plugin.zero3_init_flag == section["zero3_init_flag"]
        assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert "ACCELERATE_CONFIG_DS_FIELDS" not in os.environ  # TrainingArguments' plugin would refuse the dict

    # The Trainer's resolver (both loops use it) finds nothing to object to, and DeepSpeed parses the result.
    world = inputs.accelerate["num_processes"]
    resolver = HfTrainerDeepSpeedConfig(copy.deepcopy(config))
    try:
        resolver.trainer_config_process(types.SimpleNamespace(**vars(ns), world_size=world))
    finally:
        unset_hf_deepspeed_config()
    assert resolver.mismatches == []
    resolved = {**resolver.config, "train_batch_size": resolver.config["train_batch_size"] // world}
    DeepSpeedConfig(resolved)  # one process here: the per-process share of the batch


def test_yaml_values_fill_the_flags_left_unset(monkeypatch):
    _launch_environment(monkeypatch, CORPUS / "trl_deepspeed_zero3.yaml", [])
    request = distributed.detect_launch(None)
    ns, _ = build_parser().parse_known_args([])
    from_yaml = inline_deepspeed.apply_to_flags(request.deepspeed_inline, ns, frozenset())
    config, ns = from_yaml.deepspeed, filled(ns, from_yaml.fills)
    assert ns.fp16 and not ns.bf16 and config["fp16"]["enabled"] is True
    assert from_yaml.decided == {"gradient_accumulation_steps", "fp16"}


def test_train_py_prepare_fills_the_yaml_values_into_a_new_namespace(monkeypatch):
    """train.py's prepare stage under an inline-DeepSpeed YAML: the parsed flags stay as parsed; the run's flags
    (Launch.flags, a new namespace) hold the YAML's DeepSpeed config, accumulation and precision."""
    import copy

    from hf_scale.train.prepare import _parse, _reconcile_with_launcher

    _launch_environment(monkeypatch, CORPUS / "trl_deepspeed_zero3.yaml", [])
    parsed, given, _ = _parse([])
    before = copy.deepcopy(vars(parsed))
    launch = _reconcile_with_launcher(parsed, given)
    assert vars(parsed) == before and parsed.deepspeed is None and not parsed.fp16
    flags = launch.flags
    assert flags.fp16 and not flags.bf16 and flags.gradient_accumulation_steps == 1
    assert flags.deepspeed is launch.deepspeed_config and flags.deepspeed["zero_optimization"]["stage"] == 3


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--gradient_accumulation_steps", "8"],
            "deepspeed_config.gradient_accumulation_steps=1 but --gradient_accumulation_steps=8",
        ),
        (["--bf16"], "mixed_precision=fp16 but the flags ask for bf16"),
    ],
)
def test_a_flag_given_against_the_yaml_is_a_one_line_error(flags, message, monkeypatch):
    """check reports the same pairs as `grad-accum-mismatch` / `precision-mismatch` errors."""
    _launch_environment(monkeypatch, CORPUS / "trl_deepspeed_zero3.yaml", flags)
    request = distributed.detect_launch(None)
    ns, _ = build_parser().parse_known_args(flags)
    with pytest.raises(UserError, match=message):
        inline_deepspeed.apply_to_flags(request.deepspeed_inline, ns, given_flags(flags, vars(ns)))


def test_an_unreadable_inline_value_is_a_one_line_error(monkeypatch):
    _launch_environment(monkeypatch, CORPUS / "trl_deepspeed_zero2.yaml", [])
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "two")
    with pytest.raises(UserError, match="deepspeed_config is invalid"):
        distributed.detect_launch(None)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "4")
    with pytest.raises(UserError, match="zero_stage=4 is invalid; use 0, 1, 2 or 3"):
        distributed.detect_launch(None)


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ("deepspeed: {zero_stage: 3}\nprecision: fp16\n", None),
        ("deepspeed: {zero_stage: 2}\nprecision: fp16\n", "deepspeed.zero_stage=2 but the accelerate config's"),
        ("deepspeed: {zero_stage: 3}\nprecision: bf16\n", "precision=bf16 but"),
    ],
)
def test_hf_scale_config_next_to_an_inline_yaml_must_agree_with_it(config, error, monkeypatch, tmp_path):
    """--hf_scale_config may not silently replace the YAML's DeepSpeed settings (nor generate its own JSON)."""
    from hf_scale.train.setup.reconcile import apply_hf_scale_config

    path = tmp_path / "run.yaml"
    path.write_text("strategy: deepspeed\ntopology: {processes_per_machine: 8}\n"
                    "batch: {micro_batch_size: 1, gradient_accumulation_steps: 1}\n" + config)
    _launch_environment(monkeypatch, CORPUS / "trl_deepspeed_zero3.yaml", [])
    request = distributed.detect_launch(None)
    ns, _ = build_parser().parse_known_args([])
    from_yaml = inline_deepspeed.apply_to_flags(request.deepspeed_inline, ns, frozenset())
    ns = filled(ns, from_yaml.fills)
    if error is None:
        deepspeed = apply_hf_scale_config(str(path), request, ns, from_yaml.decided).deepspeed
        assert deepspeed is ns.deepspeed and deepspeed["zero_optimization"]["stage"] == 3
    else:
        with pytest.raises(UserError, match=error):
            apply_hf_scale_config(str(path), request, ns, from_yaml.decided)


def test_deepspeed_flag_next_to_an_inline_yaml_is_refused_by_train_py_and_check(monkeypatch, tmp_path):
    """accelerate's plugin would refuse the pair with a traceback once TrainingArguments exists."""
    flags = ["--deepspeed", str(CORPUS / "axolotl_zero1.json"), "--fp16"]
    inputs = _launch_environment(monkeypatch, CORPUS / "trl_deepspeed_zero3.yaml", flags)
    with pytest.raises(UserError, match="while the accelerate config sets DeepSpeed inline"):
        distributed.detect_launch(flags[1])
    found = {(f.code, f.key) for f in check.run_checks(inputs)}
    assert ("ds-key-duplicated", "deepspeed_config.zero_stage") in found


def test_mixed_precision_no_in_the_yaml_lets_the_flag_decide(monkeypatch):
    """TRL's inline ZeRO-2 YAML says mixed_precision 'no' (accelerate's "nothing chosen"): with --bf16 train.py builds
    a bf16 DeepSpeed config, as the HF Trainer does (it hands --bf16 to the Accelerator), and the Trainer's resolver
    finds nothing to object to; `hf-scale check` reports nothing (tests: the corpus case)."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    flags = ["--bf16"]
    inputs = _launch_environment(monkeypatch, CORPUS / "trl_deepspeed_zero2.yaml", flags)
    assert inputs.accelerate["mixed_precision"] == "no"
    request = distributed.detect_launch(None)
    ns, _ = build_parser().parse_known_args(flags)
    from_yaml = inline_deepspeed.apply_to_flags(request.deepspeed_inline, ns, given_flags(flags, vars(ns)))
    config, ns = from_yaml.deepspeed, filled(ns, from_yaml.fills)
    assert ns.bf16 and not ns.fp16 and config["bf16"]["enabled"] is True
    resolver = HfTrainerDeepSpeedConfig(copy.deepcopy(config))
    try:
        resolver.trainer_config_process(types.SimpleNamespace(**vars(ns), world_size=8))
    finally:
        unset_hf_deepspeed_config()
    assert resolver.mismatches == []
    DeepSpeedConfig({**resolver.config, "train_batch_size": resolver.config["train_batch_size"] // 8})


def test_cifar_messages_show_the_real_warmup_and_the_missing_decay(monkeypatch, capsys):
    """The default --warmup_steps is 0 (transformers compares max(1, 0)); WarmupLR never decays."""
    monkeypatch.chdir(CORPUS)
    main(["check", "--json", "launch_8gpu.yaml", "--", "--deepspeed", "deepspeedexamples_cifar.json", "--fp16"])
    findings = {f["key"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    warmup = findings["scheduler.params.warmup_num_steps"]["problem"]
    assert "--warmup_steps/--warmup_ratio=0 steps (the Trainer compares it as 1)" in warmup and "=1 steps" not in warmup
    scheduler = findings["scheduler.type"]["problem"]
    assert "WarmupLR" in scheduler and "no decay" in scheduler and "logarithmic" in scheduler


@pytest.mark.parametrize(
    ("name", "block", "refusal"),
    [
        ("deepspeedexamples_cifar_fp16_master.json", "fp16", "Fp16_master_weights_and_grads"),
        ("deepspeedexamples_bf16_master_weight.json", "bf16", "Bf16_master_weights_and_grads"),
    ],
)
def test_deepspeed_accepts_the_master_weights_files_check_accepts(name, block, refusal):
    """DeepSpeed's own parser takes the files (fp16 / bf16 master weights beside ZeRO 2 / 3); alone, without its
    zero_optimization, the precision block is what DeepSpeed refuses, which is why check judges a section beside it."""
    from deepspeed.runtime.config import DeepSpeedConfig

    config = json.loads((CORPUS / name).read_text())
    DeepSpeedConfig({**config, "train_batch_size": config.get("train_micro_batch_size_per_gpu", 1)})
    with pytest.raises(AssertionError, match=refusal):
        DeepSpeedConfig({"train_batch_size": 1, block: config[block]})


def test_the_trainer_compares_cifar_train_batch_size_as_check_says():
    """DeepSpeedExamples' cifar config sets train_batch_size 16 and no micro batch: DeepSpeed alone would derive 2 per
    GPU on 8 GPUs, but the HF Trainer's resolver compares 16 with 8 GPUs x --per_device_train_batch_size 8 and stops,
    and train.py's rule (launch_values) with it; check's `train-batch-mismatch` says the same (the corpus case)."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    from hf_scale.contract import launch_values

    config = json.loads((CORPUS / "deepspeedexamples_cifar.json").read_text())
    ns, _ = build_parser().parse_known_args(["--fp16"])
    resolver = HfTrainerDeepSpeedConfig(copy.deepcopy(config))
    try:
        resolver.trainer_config_process(types.SimpleNamespace(**vars(ns), world_size=8))
    finally:
        unset_hf_deepspeed_config()
    assert "- ds train_batch_size=16 vs hf train_batch_size (calculated)=64" in resolver.mismatches
    values = launch_values.TrainingValues(world_size=8, fp16=True)
    result = launch_values.reconcile(values, {"fp16"}, deepspeed_config=config)
    assert any("train_batch_size=16" in m and "= 64" in m for m in result.mismatches)


def test_the_counts_the_docs_state_are_the_corpus_counts():
    from collections import Counter

    copies = Counter(entry["copy"] for entry in FILES.values())
    readme = (CORPUS / "README.md").read_text()
    assert f"(`cases`: {len(CASES)} cases on {len(FILES)} files)" in readme
    assert f"**{copies['verbatim']} files are verbatim copies**" in readme
    assert f"**{copies['edited']} files are such a copy" in readme
    assert f"**{copies['written']} files were written for hf_scale**" in readme
    check_md = " ".join((REPO / "docs" / "check.md").read_text().split())
    assert f"a corpus of {len(FILES)} accelerate YAMLs" in check_md and f"per case ({len(CASES)})" in check_md
    assert f"{copies['verbatim']} are byte-for-byte copies" in check_md
    assert f"{copies['edited']} are such copies" in check_md and f"{copies['written']} were written" in check_md
