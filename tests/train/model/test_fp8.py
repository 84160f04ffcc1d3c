"""precision: fp8 on CPU: the config, the generated files read by accelerate's and DeepSpeed's own code, which
linear layers torchao converts (its real filter and conversion), the refusals before the model loads. The kernels
themselves need an H100 (benchmarks/gpu.py --fp8)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from hf_scale.config.distributed_config import config_warnings, validate_config
from hf_scale.contract.deepspeed_json import deepspeed_config
from hf_scale.errors import UserError
from hf_scale.generators.accelerate_yaml import accelerate_yaml
from hf_scale.knowledge import fp8_layers, precision_rules
from hf_scale.train.model import fp8

torchao = pytest.importorskip("torchao")  # the test extra installs it; the kernels are never run here


def _cfg(**data):
    return validate_config({"precision": "fp8", **data})


def _write_yaml(tmp_path, cfg):
    path = tmp_path / "a.yaml"
    path.write_text(accelerate_yaml(cfg, deepspeed_config_file=None, header="t"))
    return path


def _launch_env(path):
    from hf_scale.check.inputs import accelerate_launch_env

    env, error = accelerate_launch_env(path, yaml.safe_load(path.read_text()))
    assert error is None and env is not None
    return env


def test_fp8_yaml_is_read_by_accelerate_launch_into_its_recipe(tmp_path, monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import AORecipeKwargs

    path = _write_yaml(tmp_path, _cfg(strategy="ddp", topology={"processes_per_machine": 2}))
    loaded = load_config_from_file(str(path))
    assert loaded.mixed_precision == "fp8" and loaded.fp8_config["backend"] == "AO"
    # Every key is one accelerate launch reads (fp8_<key>), or it would be dropped without a word.
    dests = {action.dest for action in launch_command_parser()._actions}
    assert {f"fp8_{key}" for key in loaded.fp8_config} <= dests
    env = _launch_env(path)
    assert env["ACCELERATE_MIXED_PRECISION"] == "fp8" and env["ACCELERATE_FP8_BACKEND"] == "AO"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    recipe = AORecipeKwargs()  # accelerate builds torchao's Float8LinearConfig from the launch environment
    assert recipe.config.pad_inner_dim is True
    assert recipe.config.enable_fsdp_float8_all_gather is False  # DDP: no FSDP2 all-gather to make fp8


@pytest.mark.parametrize("backend", ["te", "msamp"])
def test_other_backends_reach_accelerates_launch_environment(tmp_path, backend):
    path = _write_yaml(tmp_path, _cfg(fp8={"backend": backend}))
    env = _launch_env(path)
    assert env["ACCELERATE_FP8_BACKEND"] == {"te": "TE", "msamp": "MSAMP"}[backend]
    if backend == "te":
        assert env["ACCELERATE_FP8_FORMAT"] == "HYBRID" and env["ACCELERATE_FP8_AMAX_HISTORY_LEN"] == "1024"
        assert env["ACCELERATE_FP8_AMAX_COMPUTE_ALGO"] == "most_recent"
    else:
        assert env["ACCELERATE_FP8_OPT_LEVEL"] == "O2"


def test_fsdp2_yaml_asks_for_the_float8_all_gather():
    cfg = _cfg(strategy="fsdp", topology={"processes_per_machine": 2}, fsdp={"cpu_ram_efficient_loading": False})
    assert precision_rules.fp8_accelerate_section(cfg)["enable_fsdp_float8_all_gather"] is True


def test_deepspeed_json_is_bf16_as_accelerate_makes_it_for_fp8():
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = _cfg(strategy="deepspeed", deepspeed={"zero_stage": 3})
    config = deepspeed_config(cfg, "resolved")
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    DeepSpeedConfig(json.loads(json.dumps(config)))  # DeepSpeed's own parser takes it
    plugin = DeepSpeedPlugin(hf_ds_config=json.loads(json.dumps(config)))
    plugin.set_mixed_precision("fp8")  # accelerate's own fp8 handling agrees with the file (raises otherwise)
    assert plugin.deepspeed_config["bf16"]["enabled"] is True
    assert "mixed_precision" not in yaml.safe_load(accelerate_yaml(cfg, deepspeed_config_file="d.json", header=""))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"strategy": "fsdp", "topology": {"processes_per_machine": 2}}, "fsdp.cpu_ram_efficient_loading=false"),
        ({"strategy": "deepspeed", "fp8": {"backend": "msamp"}}, "fp8.backend=msamp with strategy=deepspeed"),
        ({"fp8": {"backend": "cuda"}}, "fp8.backend='cuda' is invalid"),
    ],
)
def test_config_refuses_what_accelerate_would_refuse(data, message):
    with pytest.raises(UserError, match=message) as error:
        _cfg(**data)
    assert "\n" not in str(error.value)


def test_offload_is_warned():
    cfg = _cfg(strategy="deepspeed", deepspeed={"zero_stage": 3, "offload_params": "cpu"})
    assert any("precision=fp8 with offload" in w for w in config_warnings(cfg))
    assert not precision_rules.fp8_config_warnings(_cfg())


def _spec(fp8_backend, loop="trainer"):
    from hf_scale.train.setup.run_spec import RunSpec

    return RunSpec(launcher="python", strategy="single", world_size=1, loop=loop, micro_batch_size=1,
                   gradient_accumulation_steps=1, global_batch_size=1, precision="bf16", seed=0, data_seed=0,
                   packing=False, fp8_backend=fp8_backend)


def _filters_like_the_plan(handler):
    """The handler is accelerate's AO recipe with hf_scale's filter: a large layer converts, the head never does."""
    from accelerate.utils import AORecipeKwargs

    assert isinstance(handler, AORecipeKwargs)
    with torch.device("meta"):
        large, small = torch.nn.Linear(4096, 14336), torch.nn.Linear(64, 64)
    assert handler.module_filter_func(large, "model.layers.0.mlp.up_proj") is True
    assert handler.module_filter_func(large, "lm_head") is False
    assert handler.module_filter_func(small, "model.layers.0.mlp.up_proj") is False


def test_with_fp8_gives_accelerate_fp8_and_the_filtered_recipe():
    from accelerate.utils import DistributedDataParallelKwargs

    ddp = DistributedDataParallelKwargs(find_unused_parameters=True)
    given = {"mixed_precision": "bf16", "kwargs_handlers": [ddp], "step_scheduler_with_optimizer": False}
    got = fp8.with_fp8(given, _spec("torchao"))
    assert got["mixed_precision"] == "fp8" and got["step_scheduler_with_optimizer"] is False
    assert got["kwargs_handlers"][0] is ddp and len(got["kwargs_handlers"]) == 2
    _filters_like_the_plan(got["kwargs_handlers"][1])
    assert given["mixed_precision"] == "bf16" and given["kwargs_handlers"] == [ddp]  # the caller's dict is kept
    assert fp8.with_fp8(given, _spec(None)) == given
    assert fp8.with_fp8({}, _spec("torchao"))["kwargs_handlers"][0].module_filter_func is not None


@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, PartialState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


@pytest.mark.parametrize("loop", ["trainer", "accelerate"])
def test_each_loops_accelerator_trains_fp8_with_the_filtered_recipe(loop, tmp_path, fresh_accelerate_state):
    """The Accelerator each loop really builds (from real TrainingArguments, --bf16 as train.py sets it for fp8):
    accelerate's own state says fp8 with the AO backend and hf_scale's filter (accelerate builds an fp8 Accelerator
    on CPU too; train.py refuses to train without an fp8 GPU before it gets here)."""
    from transformers import AutoModelForCausalLM, TrainingArguments

    from hf_scale.contract.embedded_assets import EMBEDDED_MODEL_DIR
    from hf_scale.train.loops import manual
    from hf_scale.train.loops.trainer import HfScaleTrainer

    args = TrainingArguments(output_dir=str(tmp_path), bf16=True, report_to=[], use_cpu=True)
    spec = _spec("torchao", loop)
    if loop == "trainer":
        accelerator = HfScaleTrainer(model=AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR), args=args,
                                     spec=spec).accelerator
    else:
        accelerator = manual._accelerator(args, spec, None, None, False)
    assert accelerator.mixed_precision == "fp8" and accelerator.fp8_backend == "AO"
    _filters_like_the_plan(accelerator.ao_recipe_handler)


def test_recipe_handler_carries_the_filter():
    from accelerate.utils import AORecipeKwargs

    handler = fp8.recipe_handler("torchao")
    assert isinstance(handler, AORecipeKwargs) and handler.module_filter_func is not None
    small = torch.nn.Linear(64, 64)
    assert handler.module_filter_func(small, "model.layers.0.mlp.up_proj") is False


@pytest.mark.parametrize(
    ("capability", "importable", "expected"),
    [
        (None, True, "this machine has none"),
        ((8, 0), True, "this GPU has 8.0"),
        ((9, 0), False, "the module torchao is not importable"),
        ((8, 9), True, None),
    ],
)
def test_refusal(capability, importable, expected):
    problem = precision_rules.fp8_machine_refusal("torchao", capability=capability, importable=importable)
    assert problem is None if expected is None else expected in problem


def test_train_py_refuses_fp8_without_a_gpu_before_the_model_loads(tmp_path, capsys):
    from tests.train_helpers import run_in_process

    config = tmp_path / "fp8.yaml"
    config.write_text("precision: fp8\n")
    out = tmp_path / "out"
    code = run_in_process(["--hf_scale_config", str(config), "--output_dir", str(out), "--max_steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1] == ("train.py: error: precision=fp8 needs a GPU of compute capability >= 8.9 (Ada, Hopper or "
                       "later); this machine has none: use precision=bf16")
    assert not out.exists()  # nothing locked, loaded or written


def test_zero3_partitioned_model_is_planned_and_converted_as_the_whole_one(tmp_path):
    """Under ZeRO-3 from_pretrained builds the model inside zero.Init and accelerate hands it to torchao before
    DeepSpeed wraps it: every weight has shape (0,), which torchao's own filter cannot unpack. The plan, the log
    line and the filter accelerate receives decide from DeepSpeed's ds_shape, as for the whole model; torchao then
    converts those layers, and one ZeRO-3 step runs through them (one process, gloo: tests/_fp8_zero3_worker.py).
    The same full sizes give the MFU's parameter count."""
    import subprocess
    import sys

    from _fp8_zero3_worker import CONFIG
    from paths import TESTS
    from train_helpers import child_env, free_port
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_scale.train.loops.metrics import matmul_parameters

    out = tmp_path / "zero3.json"
    done = subprocess.run([sys.executable, str(TESTS / "_fp8_zero3_worker.py"), str(out)],
                          env={**child_env(), "MASTER_PORT": str(free_port())}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found["partitioned"] == ["(0,)"]  # what torchao's filter would have unpacked
    with torch.device("meta"):
        whole_model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        whole = fp8_layers.plan(whole_model, "torchao")
    # The partitions' full sizes (hf_scale.knowledge.partitioned) are the whole model's: its shapes, and the matmul
    # parameter count the MFU is computed from.
    assert found["full_shapes"] == {name: list(param.shape) for name, param in whole_model.named_parameters()}
    assert found["matmul_parameters"] == matmul_parameters(whole_model) > 0
    assert found["plan"] == {"converted": sorted(whole.converted), "kept": whole.kept}
    assert found["converted"] == sorted(whole.converted) == ["model.layers.0.mlp.gate_proj",
                                                             "model.layers.0.mlp.up_proj"]
    assert found["line"] == fp8_layers.describe(whole)
    # fp8 rounding (e4m3: 3 mantissa bits) in 2 of 8 matmuls moves the first loss (observed 1.2e-4 relative), and
    # by far less than 1%: the converted layers ran, with the weights ZeRO-3 gathered.
    fp8_loss, bf16_loss = found["loss"]["fp8"], found["loss"]["bf16"]
    assert fp8_loss != bf16_loss and abs(fp8_loss - bf16_loss) < 0.01 * bf16_loss
