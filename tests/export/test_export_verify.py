"""`hf-scale export` reads only checkpoints whose content verifies (every checksum of the manifest, as
`--resume_from_checkpoint` does), and the "newest intact checkpoint" every message names is a verified one.
Real checkpoints of a one-process run (in this process); one CLI run for the exit code and the one line."""

from __future__ import annotations

import json
import shutil
import sys

import datasets
import pytest
from train_helpers import run, run_in_process, tree
from transformers import AutoModelForCausalLM

from hf_scale.commands.export import export
from hf_scale.contract import checkpoint_layout, checkpoint_verification
from hf_scale.errors import UserError
from hf_scale.train.checkpoint import store

CORRUPT = "model.safetensors is corrupt (its xxh3_128 checksum differs from the one in hf_scale_complete.json)"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """OUTPUT_DIR of a 2-step run saving checkpoint-1 and checkpoint-2."""
    saved = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = str(tmp_path_factory.mktemp("hf_datasets_cache"))
    out = tmp_path_factory.mktemp("run")
    try:
        assert run_in_process(["--max_steps", "2", "--save_steps", "1", "--output_dir", str(out)]) == 0
    finally:
        datasets.config.HF_DATASETS_CACHE = saved
    return out


def _flip_a_bit(file) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the checksum tells
    file.write_bytes(bytes(data))


def test_a_checkpoint_with_one_changed_byte_is_refused_and_the_verified_one_is_named(run_dir, tmp_path, capfd):
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    newest = out / "checkpoint-2"
    _flip_a_bit(newest / checkpoint_layout.MODEL_WEIGHTS)
    assert checkpoint_layout.is_complete(newest)  # by sizes it looks complete
    damaged = tree(newest)

    with pytest.raises(UserError) as refused:
        export(newest, tmp_path / "exported")
    assert str(refused.value) == (f"CHECKPOINT_DIR {newest}: {CORRUPT}; it was left as it is; the newest verified "
                                  f"one beside it is {out / 'checkpoint-1'} (--no-verify exports it as it is)")
    assert not (tmp_path / "exported").exists() and not list(tmp_path.glob(".tmp-export-*"))
    assert tree(newest) == damaged

    # The run directory: its newest checkpoint of verified content, which the messages of a failed save name too.
    assert checkpoint_verification.newest_verified(out) == (out / "checkpoint-1", [(newest, CORRUPT)])
    assert store.intact_note(out).startswith(f"the newest intact checkpoint is {out / 'checkpoint-1'} ")
    assert store.intact_note(out, trusted={newest.resolve()}).startswith(  # what this run wrote itself
        f"the newest intact checkpoint is {newest} ")
    export(out, tmp_path / "exported")
    err = capfd.readouterr().err
    assert (f"hf-scale export: {out} is a training output directory: exporting its newest verified checkpoint, "
            f"checkpoint-1 (checkpoint-2: {CORRUPT})") in err.splitlines()
    assert "hf-scale export: verified checkpoint-1 against its hf_scale_complete.json (" in err
    AutoModelForCausalLM.from_pretrained(tmp_path / "exported")

    # --no-verify: the user's explicit choice; the sizes still match, so it is read as it is.
    export(newest, tmp_path / "unverified", verify=False)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "unverified").state_dict().keys()
    assert tree(newest) == damaged


def test_the_cli_refuses_in_one_line_with_exit_2_and_writes_nothing(run_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    for name in ("checkpoint-1", "checkpoint-2"):
        _flip_a_bit(out / name / checkpoint_layout.MODEL_WEIGHTS)
    result = run([sys.executable, "-m", "hf_scale", "export", str(out), str(tmp_path / "exported")], timeout=180)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"hf-scale: error: CHECKPOINT_DIR {out}: a training output directory without a checkpoint of verified "
        f"content (checkpoint-2: {CORRUPT}; checkpoint-1: {CORRUPT}) (its final model is already in it: "
        "from_pretrained loads that directory)"]
    assert not (tmp_path / "exported").exists() and not list(tmp_path.glob(".tmp-export-*"))


BNB_4BIT = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}


@pytest.mark.parametrize(("recorded", "config", "expected"), [
    ({"quantization": "4bit"}, None, "records quantization=4bit, but its config.json has no 4-bit quantization_config"),
    ({"quantization": None}, BNB_4BIT, "records quantization=None, but its config.json has a 4-bit"),
    ({}, BNB_4BIT, BNB_4BIT), ({}, None, None), ({"quantization": "4bit"}, BNB_4BIT, BNB_4BIT)],
    ids=["state-4bit-config-plain", "state-plain-config-4bit", "old-state-config-4bit", "old-state-config-plain",
         "agree"])
def test_a_qlora_merge_takes_the_base_its_checkpoint_records_and_refuses_a_contradiction(recorded, config, expected,
                                                                                         tmp_path):
    """The merge reloads the base with config.json's quantization_config; a checkpoint written before
    hf_scale_state.json recorded the quantization is taken by config.json, one whose state says otherwise is
    refused in one line (the adapter's base is unknown), not merged into the wrong base."""
    from hf_scale.export import qlora

    (tmp_path / "hf_scale_state.json").write_text(json.dumps({"step": 2, **recorded}))
    model_config = {"model_type": "llama", **({"quantization_config": config} if config else {})}
    (tmp_path / "config.json").write_text(json.dumps(model_config))
    if isinstance(expected, str):
        with pytest.raises(UserError, match=expected):
            qlora.quantization_of(tmp_path)
    else:
        assert qlora.quantization_of(tmp_path) == expected
