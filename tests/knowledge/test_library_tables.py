"""The knowledge `hf-scale check` keeps about the libraries (hf_scale.knowledge.library_tables) is proven against
them."""

from __future__ import annotations

import inspect
import re

import pytest

from hf_scale.check import findings
from hf_scale.commands import check
from hf_scale.knowledge import library_tables


@pytest.mark.parametrize("key", check.DS_FILE_CONFLICTING_YAML_KEYS)
def test_accelerate_really_rejects_each_duplicated_key(key, monkeypatch):
    from accelerate.utils import DeepSpeedPlugin

    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", key)
    with pytest.raises(ValueError, match="will be ignored"):
        DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}})


def test_accelerate_accepts_the_other_deepspeed_keys_next_to_a_file(monkeypatch):
    from accelerate.utils import DeepSpeedPlugin

    others = sorted(check.known_section_keys("deepspeed_config") - set(check.DS_FILE_CONFLICTING_YAML_KEYS))
    assert "zero3_init_flag" in others and "deepspeed_config_file" in others
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", ",".join(others))
    DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}})


def test_keys_written_by_accelerate_config_questionnaire_are_known():
    from accelerate.commands.config import cluster

    source = inspect.getsource(cluster)
    for section in ("deepspeed_config", "fsdp_config"):
        written = set(re.findall(rf'{section}\["(\w+)"\]', source))
        assert written, section
        assert written <= check.known_section_keys(section), written - check.known_section_keys(section)
    assert "fsdp_ignored_modules" in check.known_section_keys("fsdp_config")


def test_auto_resolution_lists_match_the_libraries_source():
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    trainer_source = inspect.getsource(HfTrainerDeepSpeedConfig)
    filled = set(re.findall(r'fill_(?:match|only)\(\s*"([\w.]+)"', trainer_source))
    trainer_lists = check.TRAINER_RESOLVED | check.TRAINER_RESOLVED_ZERO3_ONLY
    assert filled <= trainer_lists, filled - trainer_lists
    assert trainer_lists - filled <= library_tables.PLUGIN_RESOLVED
    plugin_source = inspect.getsource(DeepSpeedPlugin.__post_init__)
    for yaml_key, path in check.YAML_TO_DS_PATH.items():
        assert f'"{yaml_key}": "{path}"' in plugin_source
    accelerate_source = inspect.getsource(Accelerator._prepare_deepspeed) + inspect.getsource(
        DeepSpeedPlugin.set_mixed_precision
    )
    for path in check.ACCELERATE_RESOLVED - library_tables.PLUGIN_RESOLVED:
        assert f'"{path}"' in accelerate_source, path
    assert '"optimizer.params.betas"' not in accelerate_source


def test_no_rename_to_an_unrelated_key():
    assert findings.closest("_comment", {"comet", "comms_logger"}) is None
    assert findings.closest("wandb_project", {"wandb", "comet"}) is None
    assert findings.closest("overlap_com", {"overlap_comm", "stage"}) == "overlap_comm"


def test_the_offload_devices_and_stages_are_deepspeeds():
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    assert {e.value for e in OffloadDeviceEnum} == set(check.OFFLOAD_DEVICES)
    assert {int(e) for e in ZeroStageEnum if int(e) <= 3} == set(check.ZERO_STAGES)


def _accelerate_source() -> str:
    from pathlib import Path

    import accelerate

    return "\n".join(path.read_text() for path in Path(accelerate.__file__).parent.rglob("*.py"))


def test_the_fp8_keys_known_are_exactly_the_ones_accelerate_reads():
    """An fp8_config key is known exactly when some accelerate code reads the ACCELERATE_FP8_* variable `accelerate
    launch` exports for it; of the keys `accelerate config` itself writes, the three it misnames are unknown."""
    from accelerate.commands.config import cluster

    source = _accelerate_source()
    read = set(re.findall(r'"ACCELERATE_FP8_([A-Z0-9_]+)"', source)) | set(
        re.findall(r'env_prefix \+ "([A-Z0-9_]+)"', source))
    for name in library_tables.known_fp8_names():
        variable = name.removeprefix("fp8_").upper()
        # override_linear_precision is exported as its three OVERRIDE_* flags (setup_fp8_env)
        assert variable in read or name == "fp8_override_linear_precision", name
    written = set(re.findall(r'fp8_config\["(\w+)"\]', inspect.getsource(cluster)))
    unknown = {key for key in written if library_tables.fp8_launch_name(key) not in library_tables.known_fp8_names()}
    assert unknown == {"amax_history_length", "amax_compute_algorithm", "optimization_level"}
    assert not {library_tables.fp8_launch_name(key).removeprefix("fp8_").upper() for key in unknown} & read


@pytest.mark.parametrize(("name", "value", "recipe"), [
    ("fp8_opt_level", "O1", "MSAMPRecipeKwargs"), ("fp8_opt_level", "O9", "MSAMPRecipeKwargs"),
    ("fp8_opt_level", "o2", "MSAMPRecipeKwargs"),
    ("fp8_pad_inner_dim", True, "AORecipeKwargs"), ("fp8_pad_inner_dim", "maybe", "AORecipeKwargs"),
    ("fp8_enable_fsdp_float8_all_gather", "off", "AORecipeKwargs"),
    ("fp8_format", "hybrid", "TERecipeKwargs"), ("fp8_format", "E5M2X", "TERecipeKwargs"),
    ("fp8_amax_compute_algo", "MAX", "TERecipeKwargs"), ("fp8_margin", "x", "TERecipeKwargs"),
    ("fp8_amax_history_len", 16, "TERecipeKwargs"),
])
def test_fp8_values_are_refused_exactly_where_accelerates_recipe_raises(name, value, recipe, monkeypatch):
    """The value goes through accelerate's own launch export (setup_fp8_env) into the environment its recipe
    kwargs read; the recipe raises exactly when the check calls the value invalid. (TERecipeKwargs constructs only
    with TransformerEngine installed.)"""
    import argparse

    import accelerate.utils
    from accelerate.utils.launch import setup_fp8_env

    pytest.importorskip({"AORecipeKwargs": "torchao", "TERecipeKwargs": "transformer_engine"}.get(recipe, "accelerate"))
    for key, exported in setup_fp8_env(argparse.Namespace(**{name: value}), {}).items():
        monkeypatch.setenv(key, exported)
    try:
        getattr(accelerate.utils, recipe)()
    except ValueError:
        raised = True
    else:
        raised = False
    assert raised == (library_tables.fp8_value_problem(name, value) is not None)


@pytest.mark.parametrize("backend", ["AO", "NO", "AOO", "ao", ""])
def test_an_fp8_backend_is_refused_exactly_where_the_accelerator_raises(backend, monkeypatch):
    """A real fp8 Accelerator (on CPU) reads ACCELERATE_FP8_BACKEND, what accelerate launch exports for the YAML's
    fp8_config.backend, as its FP8BackendType. (AO and NO build torchao's recipe.)"""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    pytest.importorskip("torchao")
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", backend)
    try:
        Accelerator(mixed_precision="fp8", cpu=True)
    except ValueError:
        raised = True
    else:
        raised = False
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert raised == (library_tables.fp8_value_problem("fp8_backend", backend) is not None)


def test_the_parallelism_text_settings_are_the_ones_accelerate_reads_as_text():
    """Every text-valued `parallelism_config` launch option except sp_seq_length (an int in text) is judged by the
    accelerate dataclass that reads it, and an invalid value of each is refused."""
    import dataclasses

    from accelerate import ParallelismConfig
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import DeepSpeedSequenceParallelConfig, TorchContextParallelConfig

    options = {action.dest.removeprefix("parallelism_config_") for action in launch_command_parser()._actions
               if action.dest.startswith("parallelism_config_") and action.type is str}
    assert options - {"sp_seq_length"} == set(library_tables.PARALLELISM_STRING_SETTINGS)
    fields = {f.name for cls in (ParallelismConfig, TorchContextParallelConfig, DeepSpeedSequenceParallelConfig)
              for f in dataclasses.fields(cls)}
    for name in library_tables.PARALLELISM_STRING_SETTINGS:
        assert name in fields
        assert library_tables.parallelism_value_problem(f"parallelism_config_{name}", "no-such-thing"), name
