"""`hf-scale export` of the model files accelerate's FSDP plugin writes on GPUs (the manual loop's `save_state`,
the Trainer's checkpoints): built in-process, exported in-process, compared tensor by tensor. Fast (no launches).

FSDP2 files are written by accelerate's own `save_fsdp_model` (it runs on CPU on an unsharded model: FSDP2's
`get_model_state_dict` and DCP need no process group). FSDP1's `save_fsdp_model` cannot run without an FSDP1
wrapper, which needs a process group and, under accelerate, a GPU; its files are built in the same format: the
same names and nesting as accelerate/utils/fsdp_utils.py::save_fsdp_model (accelerate 1.15):
  FULL_STATE_DICT     `torch.save(state_dict, os.path.join(output_dir, f"{FSDP_MODEL_NAME}.bin"))` (model_index 0)
  SHARDED_STATE_DICT  `dist_cp.save(state_dict={"model": state_dict},
                       storage_writer=dist_cp.FileSystemWriter(os.path.join(output_dir, f"{FSDP_MODEL_NAME}_0")))`
  use_dcp=False / LOCAL_STATE_DICT  `f"{FSDP_MODEL_NAME}_0_rank{process_index}.bin"` / `..._rank{i}.bin` per rank
with FSDP_MODEL_NAME = "pytorch_model_fsdp" (accelerate/utils/constants.py).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import tree
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_scale.commands import cli
from hf_scale.contract import checkpoint_layout
from hf_scale.contract.embedded_assets import EMBEDDED_MODEL_DIR
from hf_scale.train.checkpoint import store
from hf_scale.train.setup.run_spec import RunSpec

STEP = 4


@pytest.fixture(scope="module")
def trained():
    """The embedded tiny Llama moved off its shipped weights (seeded): what a run would have trained."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return model


@pytest.fixture
def accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


def _accelerate_save(version: int, state_dict_type: str):
    """accelerate's own saver, as `Accelerator.save_state` calls it for model 0."""
    def write(model, path, accelerator):
        from accelerate.utils import FullyShardedDataParallelPlugin
        from accelerate.utils.fsdp_utils import save_fsdp_model

        plugin = FullyShardedDataParallelPlugin(fsdp_version=version, state_dict_type=state_dict_type)
        save_fsdp_model(plugin, accelerator, model, str(path), 0)
    return write


def _fsdp1_sharded(model, path, accelerator):
    import torch.distributed.checkpoint as dcp

    # FSDP1's SHARDED_STATE_DICT has the module's own names (FSDP1's state-dict hooks clean them).
    dcp.save({"model": model.state_dict()},
             storage_writer=dcp.FileSystemWriter(str(path / checkpoint_layout.ACCELERATE_FSDP_SHARDED)))


def _fsdp1_full_compiled(model, path, accelerator):
    # A --torch_compile run wrapped before FSDP1: its names carry torch.compile's `_orig_mod.`.
    state = torch.compile(model).state_dict()
    assert all(name.startswith("_orig_mod.") for name in state)
    torch.save(state, path / checkpoint_layout.ACCELERATE_FSDP_FULL)


def _checkpoint(root, model, write_weights, accelerator, loop: str):
    """checkpoint-STEP as the loops lay it out: accelerate's FSDP files, the model files export rebuilds from
    (checkpoint.write_model_files, as both savers call it), hf_scale's state file and manifest."""
    path = checkpoint_layout.checkpoint_dir(root, STEP)
    path.mkdir(parents=True)
    write_weights(model, path, accelerator)
    store.write_model_files(path, model, AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR))
    spec = RunSpec(launcher="accelerate", strategy="fsdp", world_size=2, loop=loop, micro_batch_size=1,
                   gradient_accumulation_steps=1, global_batch_size=2, precision="no", seed=42, data_seed=42,
                   packing=False)
    position = {"epoch": 0, "samples_consumed_in_epoch": 8} if loop == "accelerate" else {}
    store.write_state(path, step=STEP, spec=spec, **position)
    store.write_manifest(path, STEP)
    return path


def _export(*argv) -> int:
    try:
        return cli.main(["export", *map(str, argv)])
    except SystemExit as exit_:
        return exit_.code


FORMATS = [
    ("fsdp2-sharded", _accelerate_save(2, "SHARDED_STATE_DICT"), "accelerate",
     f"{checkpoint_layout.ACCELERATE_FSDP_SHARDED}/"),
    ("fsdp2-full", _accelerate_save(2, "FULL_STATE_DICT"), "accelerate", checkpoint_layout.ACCELERATE_FSDP_FULL),
    ("fsdp1-sharded-trainer", _fsdp1_sharded, "trainer", f"{checkpoint_layout.ACCELERATE_FSDP_SHARDED}/"),
    ("fsdp1-full-compiled", _fsdp1_full_compiled, "accelerate", checkpoint_layout.ACCELERATE_FSDP_FULL),
]


@pytest.mark.parametrize(("write_weights", "loop", "read_from"), [f[1:] for f in FORMATS], ids=[f[0] for f in FORMATS])
def test_accelerate_fsdp_checkpoints_export_to_the_trained_tensors(trained, accelerator, tmp_path, capsys,
                                                                   write_weights, loop, read_from):
    ckpt = _checkpoint(tmp_path / "run", trained, write_weights, accelerator, loop)
    found = checkpoint_layout.detect_layout(ckpt)
    assert (found.kind, found.weights, found.loop) == (checkpoint_layout.CHECKPOINT,
                                                      checkpoint_layout.ACCELERATE_FSDP, loop)

    assert _export(ckpt, tmp_path / "out", "--max-shard-size", "200KB") == 0
    assert f"in {read_from}" in capsys.readouterr().err  # progress names the files read

    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    expected = trained.state_dict()
    got = exported.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
    assert not torch.equal(got["model.embed_tokens.weight"],
                           AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR).model.embed_tokens.weight)


def test_bf16_export_of_accelerate_fsdp_shards_casts_every_weight(trained, accelerator, tmp_path):
    ckpt = _checkpoint(tmp_path / "run", trained, _accelerate_save(2, "SHARDED_STATE_DICT"), accelerator,
                       "accelerate")
    assert _export(ckpt, tmp_path / "out", "--dtype", "bf16") == 0
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    torch.testing.assert_close(tensors["model.norm.weight"], trained.model.norm.weight.to(torch.bfloat16),
                               rtol=0, atol=0)


def _per_rank(model, path, accelerator):
    # save_fsdp_model's SHARDED_STATE_DICT with use_dcp=False: each rank torch.saves its own slices.
    for rank in range(2):
        torch.save(model.state_dict(), path / f"{checkpoint_layout.ACCELERATE_FSDP_SHARDED}_rank{rank}.bin")


def test_per_rank_accelerate_fsdp_files_are_refused_in_one_line_without_writing(trained, accelerator, tmp_path,
                                                                                capsys):
    ckpt = _checkpoint(tmp_path / "run", trained, _per_rank, accelerator, "accelerate")
    before = tree(tmp_path)
    assert _export(ckpt, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "per-rank FSDP files (pytorch_model_fsdp_0_rank0.bin, 2 in all)" in err[0]
    assert "state_dict_type full" in err[0] and "Traceback" not in err[0]
    assert tree(tmp_path) == before


def test_a_damaged_accelerate_fsdp_file_is_one_line_naming_the_checkpoint(trained, accelerator, tmp_path, capsys):
    ckpt = _checkpoint(tmp_path / "run", trained, _accelerate_save(2, "FULL_STATE_DICT"), accelerator, "trainer")
    weights = ckpt / checkpoint_layout.ACCELERATE_FSDP_FULL
    weights.write_bytes(b"not a torch file" + bytes(weights.stat().st_size - 16))  # same size: the manifest passes
    assert _export(ckpt, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"CHECKPOINT_DIR {ckpt}: cannot be read" in err[0]
    assert not (tmp_path / "out").exists()



@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_the_trainers_adapter_only_fsdp_save_of_a_lora_model_exports_the_trained_adapter(trained, accelerator,
                                                                                          tmp_path, state_dict_type):
    """The Trainer saves LoRA under FSDP with save_fsdp_model(adapter_only=True) (transformers'
    get_fsdp_ckpt_kwargs): peft's adapter-only names when sharded, the trainable tensors only when full."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR),
                          LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in lora.named_parameters():
            if "lora_B" in name:  # zero at the start: non-zero values prove the trained adapter was read
                parameter.normal_()

    def write(model, path, accelerator):
        from accelerate.utils import FullyShardedDataParallelPlugin
        from accelerate.utils.fsdp_utils import save_fsdp_model

        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=state_dict_type)
        save_fsdp_model(plugin, accelerator, model, str(path), 0, adapter_only=True)

    ckpt = _checkpoint(tmp_path / "run", lora, write, accelerator, "trainer")
    assert _export(ckpt, tmp_path / "adapter", "--lora", "adapter") == 0
    exported = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    expected = get_peft_model_state_dict(lora)
    assert exported.keys() == expected.keys() and any("lora_B" in name for name in expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=name)
