"""The knowledge `hf-scale check` keeps about the libraries (hf_scale.check.knowledge) is proven against them."""

from __future__ import annotations

import inspect
import re

import pytest

from hf_scale import check
from hf_scale.check import findings, knowledge


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
    assert trainer_lists - filled <= knowledge.PLUGIN_RESOLVED
    plugin_source = inspect.getsource(DeepSpeedPlugin.__post_init__)
    for yaml_key, path in check.YAML_TO_DS_PATH.items():
        assert f'"{yaml_key}": "{path}"' in plugin_source
    accelerate_source = inspect.getsource(Accelerator._prepare_deepspeed) + inspect.getsource(
        DeepSpeedPlugin.set_mixed_precision
    )
    for path in check.ACCELERATE_RESOLVED - knowledge.PLUGIN_RESOLVED:
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
