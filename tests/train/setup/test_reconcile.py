"""`--hf_scale_config` (hf_scale.train.setup.reconcile): every DistributedConfig field the launch scripts deliver
through it fills the train.py flag left unset, is accepted when the flag says the same, and is refused in
one line naming the field, both values, when the flag says otherwise. In process, on train.py's own parser (the fp8
backend against the accelerate YAML: through `accelerate launch`).
"""

from __future__ import annotations

import re

import pytest
import yaml

from hf_scale.contract.config_flags import checkpointing_flag, checkpointing_spelling, filled
from hf_scale.contract.launch_request import LaunchRequest
from hf_scale.contract.parser import build_parser
from hf_scale.errors import UserError
from hf_scale.knowledge.rules import given_flags
from hf_scale.train.setup.reconcile import apply_hf_scale_config, typed_flags

# Non-default values everywhere (the defaults would hide a field that is never applied).
CONFIG = {
    "strategy": "ddp",
    "precision": "no",
    "gradient_clipping": 0.7,
    "activation_checkpointing": True,
    "topology": {"processes_per_machine": 2},
    "batch": {"micro_batch_size": 1, "gradient_accumulation_steps": 3},
    "optimizer": {"lr": 3e-4, "betas": [0.85, 0.97], "eps": 1e-7, "weight_decay": 0.05},
}
# field of the config, train.py flag, the config's value, the value as typed, another value as typed
FIELDS = [
    ("batch.micro_batch_size", "per_device_train_batch_size", 1, "1", "8"),
    ("batch.gradient_accumulation_steps", "gradient_accumulation_steps", 3, "3", "1"),
    ("gradient_clipping", "max_grad_norm", 0.7, "0.7", "1.0"),
    ("optimizer.lr", "learning_rate", 3e-4, "0.0003", "5e-5"),
    ("optimizer.betas[0]", "adam_beta1", 0.85, "0.85", "0.9"),
    ("optimizer.betas[1]", "adam_beta2", 0.97, "0.97", "0.999"),
    ("optimizer.eps", "adam_epsilon", 1e-7, "1e-7", "1e-8"),
    ("optimizer.weight_decay", "weight_decay", 0.05, "0.05", "0.0"),
    ("activation_checkpointing", "gradient_checkpointing", True, "true", "false"),
]


def _value(ns, flag: str):
    """The parsed value of ``flag``; activation checkpointing under the name train.py keeps it (transformers 5's
    --activation_checkpointing, of which --gradient_checkpointing is the older spelling)."""
    return getattr(ns, checkpointing_flag(ns) if flag == "gradient_checkpointing" else flag)


def _request(world_size: int = 2, **changes) -> LaunchRequest:
    fields = dict(launcher="torchrun", world_size=world_size, strategy="ddp" if world_size > 1 else "single",
                  deepspeed_config_file=None, zero_stage=None, mixed_precision=None)
    return LaunchRequest(**{**fields, **changes})


def _apply(tmp_path, argv: list[str], config: dict = CONFIG, request: LaunchRequest | None = None):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = ["--hf_scale_config", str(path), *argv]
    ns, unknown = build_parser().parse_known_args(argv)
    assert not unknown
    result = apply_hf_scale_config(str(path), request or _request(), ns, given_flags(argv, vars(ns)))
    return filled(ns, result.fills), result.request, result.deepspeed


def test_every_field_fills_the_flag_left_unset(tmp_path):
    defaults, _ = build_parser().parse_known_args([])
    ns, _, deepspeed = _apply(tmp_path, [])
    for field, flag, value, _, _ in FIELDS:
        assert _value(ns, flag) == value != _value(defaults, flag), field
    assert (ns.bf16, ns.fp16) == (False, False)
    assert deepspeed is None
    # What the launcher's config (a DeepSpeed JSON, accelerate's YAML) is then compared with as given.
    assert {flag for _, flag, *_ in FIELDS if flag != "gradient_checkpointing"} <= typed_flags(ns, frozenset())


@pytest.mark.parametrize(("field", "flag", "value", "same", "other"), FIELDS, ids=[f[0] for f in FIELDS])
def test_a_flag_that_says_the_same_is_accepted(field, flag, value, same, other, tmp_path):
    ns, _, _ = _apply(tmp_path, [f"--{flag}", same])
    assert _value(ns, flag) == value


@pytest.mark.parametrize(("field", "flag", "value", "same", "other"), FIELDS, ids=[f[0] for f in FIELDS])
def test_a_flag_that_says_otherwise_is_refused_in_one_line(field, flag, value, same, other, tmp_path):
    with pytest.raises(UserError) as refused:
        _apply(tmp_path, [f"--{flag}", other])
    message = str(refused.value)
    assert "\n" not in message
    shown = str(value).lower() if isinstance(value, bool) else str(value)
    assert f"{field}={shown} but --{flag}=" in message, message


@pytest.mark.parametrize(("field", "flag", "value", "same", "other"), FIELDS, ids=[f[0] for f in FIELDS])
def test_the_dashed_spelling_of_a_flag_is_refused_too(field, flag, value, same, other, tmp_path):
    """HfArgumentParser accepts --learning-rate for --learning_rate: no silent override by that spelling."""
    with pytest.raises(UserError, match=re.escape(f"{field}=") + f".* but --{flag}="):
        _apply(tmp_path, [f"--{flag.replace('_', '-')}={other}"])


@pytest.mark.parametrize(
    ("precision", "flags", "error"),
    [
        ("no", [], None),
        ("bf16", ["--bf16"], None),
        ("fp16", ["--fp16", "true"], None),
        ("no", ["--bf16"], "precision=no but the flags ask for bf16"),
        ("bf16", ["--fp16"], "precision=bf16 but the flags ask for fp16"),
        ("fp16", ["--bf16", "false"], "precision=fp16 but the flags ask for no"),
    ],
)
def test_precision_fills_or_must_match_the_flags(precision, flags, error, tmp_path):
    config = {**CONFIG, "precision": precision}
    if error:
        with pytest.raises(UserError, match=error):
            _apply(tmp_path, flags, config)
        return
    ns, _, _ = _apply(tmp_path, flags, config)
    assert (ns.bf16, ns.fp16) == (precision == "bf16", precision == "fp16")


def test_precision_must_match_the_accelerate_yaml(tmp_path):
    with pytest.raises(UserError, match="precision=no but the accelerate config has mixed_precision=bf16"):
        _apply(tmp_path, [], request=_request(launcher="accelerate", mixed_precision="bf16"))


def test_no_clipping_is_max_grad_norm_0_and_a_norm_against_it_is_refused(tmp_path):
    config = {**CONFIG, "gradient_clipping": None}
    ns, _, _ = _apply(tmp_path, [], config)
    assert ns.max_grad_norm == 0.0
    with pytest.raises(UserError, match="gradient_clipping=0.0 but --max_grad_norm=1.0"):
        _apply(tmp_path, ["--max_grad_norm", "1.0"], config)


def test_the_global_batch_needs_the_configured_world_size(tmp_path):
    """global = micro x accumulation x world: micro and accumulation are filled above, the world is checked."""
    with pytest.raises(UserError, match="world_size=2 .* but the torchrun launcher started WORLD_SIZE=4"):
        _apply(tmp_path, [], request=_request(world_size=4))


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--auto_find_batch_size"], "--auto_find_batch_size would change batch.micro_batch_size=1"),
        (["--optim", "sgd"], "optimizer.betas and optimizer.eps are AdamW's, but --optim=sgd"),
    ],
)
def test_what_would_change_the_configured_values_is_refused(flags, error, tmp_path):
    with pytest.raises(UserError, match=error):
        _apply(tmp_path, flags)


def test_an_adamw_optim_is_accepted(tmp_path):
    ns, _, _ = _apply(tmp_path, ["--optim", "adamw_torch"])
    assert (ns.adam_beta1, ns.adam_beta2, ns.adam_epsilon) == (0.85, 0.97, 1e-7)


def test_deepspeed_under_torchrun_gets_the_auto_json_built_from_the_config(tmp_path):
    config = {**CONFIG, "strategy": "deepspeed", "deepspeed": {"zero_stage": 2}}
    ns, request, deepspeed = _apply(tmp_path, [], config, request=_request(strategy="ddp"))
    assert request.strategy == "deepspeed" and request.zero_stage == 2
    assert deepspeed["zero_optimization"]["stage"] == 2
    assert deepspeed["train_micro_batch_size_per_gpu"] == "auto"  # the Trainer fills it from the flags below
    assert (ns.per_device_train_batch_size, ns.gradient_accumulation_steps) == (1, 3)


def _resolved_deepspeed(tmp_path, ds_config: dict):
    """A "resolved" JSON launched with --deepspeed next to --hf_scale_config (the torchrun/deepspeed scripts)."""
    import json

    path = tmp_path / "run.json"
    path.write_text(json.dumps(ds_config))
    request = _request(world_size=1, strategy="deepspeed", deepspeed_config_file=str(path), zero_stage=2)
    return request, path


@pytest.mark.parametrize("lr_in_json", [3e-4, 1e-3])
def test_a_resolved_deepspeed_json_agrees_with_the_flags_or_is_refused_in_one_line(lr_in_json, tmp_path,
                                                                                     monkeypatch):
    """The JSON's optimizer block holds lr/betas/eps/weight decay, which transformers compares with the flags
    --hf_scale_config filled: the generated JSON passes transformers' own comparison; a JSON whose lr was
    edited is refused in one line before transformers' traceback could happen."""
    import json
    from types import SimpleNamespace

    from accelerate.state import AcceleratorState
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    from hf_scale.config.distributed_config import validate_config
    from hf_scale.contract.deepspeed_json import deepspeed_config
    from hf_scale.train.setup.reconcile import follow_launcher_config

    config = {**CONFIG, "strategy": "deepspeed", "deepspeed": {"zero_stage": 2, "torch_adam": True},
              "topology": {"processes_per_machine": 1}}  # one process: what TrainingArguments sees here
    ds_config = deepspeed_config(validate_config(config), "resolved")
    ds_config["optimizer"]["params"]["lr"] = lr_in_json
    request, path = _resolved_deepspeed(tmp_path, ds_config)
    ns, request, deepspeed = _apply(tmp_path, ["--deepspeed", str(path)], config, request=request)
    assert deepspeed == str(path)
    if lr_in_json != 3e-4:
        with pytest.raises(UserError, match=rf"optimizer.params.lr={lr_in_json} .*--learning_rate") as refused:
            follow_launcher_config(ns, typed_flags(ns, frozenset()), request, ds_config)
        assert "\n" not in str(refused.value)
        return
    ns = filled(ns, follow_launcher_config(ns, typed_flags(ns, frozenset()), request, ds_config))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False, fp16=False,
        per_device_train_batch_size=ns.per_device_train_batch_size,
        gradient_accumulation_steps=ns.gradient_accumulation_steps, max_grad_norm=ns.max_grad_norm,
        learning_rate=ns.learning_rate, adam_beta1=ns.adam_beta1, adam_beta2=ns.adam_beta2,
        adam_epsilon=ns.adam_epsilon, weight_decay=ns.weight_decay, max_steps=10,
    )
    try:
        hf = HfTrainerDeepSpeedConfig(json.loads(json.dumps(ds_config)))
        hf.trainer_config_process(args)
        # transformers' own comparison (batch triple, clipping, precision, optimizer values): raises on a mismatch.
        hf.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=64)),
                                   num_training_steps=10)
    finally:
        unset_hf_deepspeed_config()
        AcceleratorState._reset_state(reset_partial_state=True)


FSDP_AC = {**CONFIG, "strategy": "fsdp", "activation_checkpointing": False, "fsdp": {"activation_checkpointing": True}}


@pytest.mark.parametrize(
    ("launcher", "yaml_value", "flags", "error"),
    [
        ("accelerate", "true", [], None),
        ("accelerate", "false", [], "fsdp.activation_checkpointing=true but the accelerate config has "
                                     "fsdp_activation_checkpointing=false"),
        ("accelerate", "true", ["--gradient_checkpointing"], "checkpoints the decoder layers already"),
        ("torchrun", None, [], "without a GPU train.py shards with torch's fully_shard"),
    ],
)
def test_fsdp_activation_checkpointing_must_be_what_the_fsdp_plugin_applies(launcher, yaml_value, flags, error,
                                                                            tmp_path, monkeypatch):
    """FSDP's own checkpointing is applied by accelerate's FSDP plugin (its YAML's fsdp_activation_checkpointing,
    seen as FSDP_ACTIVATION_CHECKPOINTING), never by a flag; where nothing would apply it, it is refused."""
    if yaml_value is not None:
        monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", yaml_value)
    strategy = "fsdp" if launcher == "accelerate" else "ddp"
    request = _request(launcher=launcher, strategy=strategy, mixed_precision="no" if launcher == "accelerate" else None)
    if error:
        with pytest.raises(UserError, match=error):
            _apply(tmp_path, [*flags, "--loop", "accelerate"], FSDP_AC, request=request)
        return
    ns, _, _ = _apply(tmp_path, ["--loop", "accelerate"], FSDP_AC, request=request)
    assert _value(ns, "gradient_checkpointing") is False  # the plugin checkpoints the layers, the model's own stays off


def test_reconciling_returns_fills_and_never_changes_the_parsed_namespace(tmp_path):
    """Each step reads train.py's parsed flags and returns the values to fill; the namespace it was given stays as
    it is (hf_scale.train.setup.reconcile is pure), the filled flags are a new namespace."""
    import copy

    from hf_scale.train.setup.reconcile import follow_launcher_config

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, "strategy": "deepspeed", "deepspeed": {"zero_stage": 2}}))
    argv = ["--hf_scale_config", str(path), "--gradient_checkpointing", "--warmup_steps", "2"]
    ns, _ = build_parser().parse_known_args(argv)
    before = copy.deepcopy(vars(ns))
    spelling = checkpointing_spelling(ns)
    assert spelling == {"activation_checkpointing": True, "gradient_checkpointing": None,
                        "gradient_checkpointing_kwargs": None}
    given = given_flags(argv, vars(ns))
    result = apply_hf_scale_config(str(path), _request(strategy="ddp"), ns, given)
    assert vars(ns) == before
    assert {k: result.fills[k] for k in ("per_device_train_batch_size", "gradient_accumulation_steps", "bf16")} == {
        "per_device_train_batch_size": 1, "gradient_accumulation_steps": 3, "bf16": False}
    assert result.deepspeed["zero_optimization"]["stage"] == 2 and result.request.strategy == "deepspeed"
    flags = filled(ns, result.fills)
    assert flags is not ns and vars(ns) == before and flags.adam_beta1 == 0.85
    followed = follow_launcher_config(flags, typed_flags(flags, given), result.request, result.deepspeed)
    assert followed == {} and vars(ns) == before and vars(flags) == {**before, **result.fills}


def test_train_py_prepare_builds_the_run_flags_as_a_new_namespace(tmp_path, monkeypatch):
    """train.py's prepare stage: the parsed flags stay as parsed, Launch.flags holds them with every fill."""
    import copy

    from hf_scale.train.prepare import _parse, _reconcile_with_launcher

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, "strategy": "single", "topology": {"processes_per_machine": 1}}))
    parsed, argv, _ = _parse(["--hf_scale_config", str(path), "--warmup_ratio", "0.1"])
    before = copy.deepcopy(vars(parsed))
    launch = _reconcile_with_launcher(parsed, argv)
    assert vars(parsed) == before
    assert launch.flags is not parsed and launch.flags.warmup_steps == 0.1 and launch.flags.learning_rate == 3e-4
    assert (launch.flags.per_device_train_batch_size, launch.flags.gradient_accumulation_steps) == (1, 3)


def test_an_fp8_backend_other_than_the_accelerate_yamls_is_refused_by_train_py(tmp_path):
    """`accelerate launch` (its own code, one process) exports the YAML's fp8_config backend; train.py refuses a
    --hf_scale_config that asks for another one in one line, exit 2, before the process group, the output directory
    or the model (and before the no-fp8-GPU refusal that would follow on this machine)."""
    from train_helpers import launcher_command, run, training_traceback_frames

    launch = tmp_path / "te.yaml"
    launch.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO",
                                      "mixed_precision": "fp8", "fp8_config": {"backend": "TE"}, "num_machines": 1,
                                      "num_processes": 1, "use_cpu": False}))
    config = tmp_path / "ao.yaml"
    config.write_text("precision: fp8\nfp8: {backend: torchao}\n")
    out = tmp_path / "out"
    result = run([*launcher_command("accelerate", config=launch), "--hf_scale_config", str(config),
                  "--output_dir", str(out), "--max_steps", "1"], timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("train.py: error:")]
    assert errors == [f"train.py: error: --hf_scale_config={config}: fp8.backend=torchao but the accelerate "
                      "config's fp8_config asks for te"], result.stderr[-3000:]
    assert "exit status 2" in result.stderr and not training_traceback_frames(result.stderr)
    assert not out.exists()


HSDP = {"strategy": "fsdp", "precision": "no", "fsdp": {"sharding": "hybrid_shard"},
        "topology": {"num_machines": 2, "processes_per_machine": 2, "main_process_ip": "10.0.0.1"}}


def test_fsdp2_hybrid_shard_is_refused_where_train_py_sets_fsdp_up_itself(tmp_path):
    """Under torchrun train.py shards with fully_shard (CPU) or hands accelerate a plugin without a mesh (GPU):
    either would shard over all 4 ranks, not HSDP's 2 x 2; accelerate launch with the generated YAML has the mesh."""
    with pytest.raises(UserError) as refused:
        _apply(tmp_path, ["--loop", "accelerate"], HSDP, _request(4))
    assert str(refused.value) == (
        f"--hf_scale_config={tmp_path / 'run.yaml'}: fsdp.sharding=hybrid_shard (dp_replicate=2 x dp_shard=2) under "
        "torchrun: train.py's own FSDP2 setup has no 2-D mesh and would shard over all 4 ranks; launch it with "
        "launch/run.accelerate.sh (its YAML's parallelism_config gives accelerate the HSDP mesh)")
    full_shard = {**HSDP, "fsdp": {"sharding": "full_shard"}}  # the same world, one dimension: train.py runs it
    _, request, _ = _apply(tmp_path, ["--loop", "accelerate"], full_shard, _request(4))
    assert request.fsdp_settings["sharding"] == "full_shard"


def test_hsdp_from_the_parallelism_sizes_alone_is_named_by_them(tmp_path):
    """dp_replicate x dp_shard written in the parallelism section (fsdp.sharding left full_shard) is HSDP too; the
    refusal names the sizes, not a hybrid_shard the user never wrote."""
    sizes = {**HSDP, "fsdp": {"sharding": "full_shard"}, "parallelism": {"dp_replicate": 2, "dp_shard": 2}}
    with pytest.raises(UserError) as refused:
        _apply(tmp_path, ["--loop", "accelerate"], sizes, _request(4))
    assert str(refused.value).startswith(f"--hf_scale_config={tmp_path / 'run.yaml'}: HSDP (dp_replicate=2 x "
                                         "dp_shard=2) under torchrun: ")
    assert "hybrid_shard" not in str(refused.value)


TP2 = {"strategy": "fsdp", "precision": "no", "topology": {"processes_per_machine": 4},
       "parallelism": {"dp_shard": 2, "tp": 2}}
SP2 = {"strategy": "deepspeed", "precision": "no", "topology": {"processes_per_machine": 4},
       "parallelism": {"sp": 2, "dp_shard": 2}}


@pytest.mark.parametrize(
    ("config", "flags", "error"),
    [
        (TP2, ["--lora_r", "4"], "--lora_r=4 with tensor parallelism (--hf_scale_config={path}: parallelism.tp=2): "),
        (SP2, ["--attn_implementation", "eager"],
         "--hf_scale_config={path}: parallelism.sp=2 with --attn_implementation=eager: Ulysses runs here around sdpa"),
        (SP2, ["--packing"], "--hf_scale_config={path}: parallelism.sp=2 with --packing: "),
    ],
    ids=["tp-lora", "sp-eager", "sp-packing"],
)
def test_flags_a_layout_cannot_run_with_are_refused_before_the_process_group(config, flags, error, tmp_path):
    """tp with LoRA and sp with packing or a kernel other than SDPA: refused with the config, not after the model
    loaded (the rule `hf-scale check` applies too: hf_scale.contract.parallel_refusals.flag_refusal)."""
    with pytest.raises(UserError) as refused:
        _apply(tmp_path, flags, config, _request(4))
    assert str(refused.value).startswith(error.format(path=tmp_path / "run.yaml"))
