"""hf_scale.train.setup.loop_flags: the table of the TrainingArguments flags the manual loop applies cannot drift from
the code (an AST scan of the manual loop's path), and `--loop accelerate` refuses the others (the bad-input
cases are in tests/train/test_train_bad_input.py)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest
from paths import REPO
from transformers import Trainer, TrainingArguments

from hf_scale.contract.parser import build_parser
from hf_scale.train.prepare import _validate_flags
from hf_scale.train.setup import loop_flags

FIELDS = [f.name for f in dataclasses.fields(TrainingArguments) if f.init]
ROOTS = ("hf_scale.train.loops.manual", "hf_scale.train.main")
NOT_ON_THE_PATH = {
    "hf_scale.train.loops.trainer": "the Trainer's path (main imports it for --loop trainer only)",
    "hf_scale.train.setup.loop_flags": "the table itself",
    # They compare the flags with the launcher's configs and fill them; they apply no flag themselves.
    "hf_scale.train.setup.reconcile": "", "hf_scale.contract.config_flags": "", "hf_scale.contract.launch_values": "",
    "hf_scale.contract.inline_deepspeed": "", "hf_scale.knowledge.deepspeed_overrides": "",
    "hf_scale.config.distributed_config": "", "hf_scale.contract.deepspeed_json": "",
    "hf_scale.contract.flag_values": "checks each flag's range (both loops); applies none",
}
RECEIVERS = {"args", "ns", "parsed"}
"""Names the flags go by on the path: `args.X`, `self.args.X`, `run.args.X`, `ns.X`, `getattr(args, "X")`."""
VIA = {
    "Trainer.get_optimizer_cls_and_kwargs": (Trainer.get_optimizer_cls_and_kwargs, "get_optimizer_cls_and_kwargs"),
    "TrainingArguments.get_warmup_steps": (TrainingArguments.get_warmup_steps, "get_warmup_steps"),
    "TrainingArguments.__post_init__": (TrainingArguments.__post_init__, "TrainingArguments"),
}
"""The transformers callables the table names: the function, and the name whose call on the path runs it."""


def _file(module: str) -> Path:
    path = REPO / Path(*module.split("."))
    return path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__init__.py"


def _hf_scale_imports(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hf_scale"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if _file(full).exists() else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("hf_scale")}
    return found


def manual_loop_path() -> dict[str, ast.AST]:
    """The hf_scale modules the manual loop's run imports (transitively, also lazily), parsed."""
    trees, todo = {}, list(ROOTS)
    while todo:
        module = todo.pop()
        if module in trees or module in NOT_ON_THE_PATH:
            continue
        trees[module] = ast.parse(_file(module).read_text())
        todo += sorted(_hf_scale_imports(trees[module]) - trees.keys())
    return trees


def _receiver(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id in RECEIVERS) or (
        isinstance(node, ast.Attribute) and node.attr == "args")


def fields_read(tree: ast.AST) -> set[str]:
    read = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _receiver(node.value):
            read.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and _receiver(node.args[0]) and isinstance(node.args[1], ast.Constant)):
            read.add(node.args[1].value)
    return read & set(FIELDS)


def names_called(tree: ast.AST) -> set[str]:
    called = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            called.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None))
            called |= {a.id for a in node.args if isinstance(a, ast.Name)}  # _dataclass_from(ns, TrainingArguments)
    return called


@pytest.fixture(scope="module")
def path():
    trees = manual_loop_path()
    assert {"hf_scale.train.loops.manual", "hf_scale.train.loops.evaluation", "hf_scale.train.loops.metrics",
            "hf_scale.train.data.batches", "hf_scale.train.model.load", "hf_scale.train.model.liger",
            "hf_scale.train.checkpoint.store", "hf_scale.files.hub"} <= trees.keys()
    return trees


def test_the_tables_name_real_fields_once():
    tables = [set(loop_flags.APPLIED), set(loop_flags.NO_EFFECT), set(loop_flags.IN_NEITHER_LOOP)]
    for table in tables:
        assert table <= set(FIELDS), table - set(FIELDS)
    assert sum(map(len, tables)) == len(set().union(*tables)), "a field in two tables"


def test_every_field_the_table_applies_is_read_on_the_manual_loops_path(path):
    read = set().union(*(fields_read(tree) for tree in path.values()))
    called = set().union(*(names_called(tree) for tree in path.values()))
    for name, applied in loop_flags.APPLIED.items():
        if applied.via is None:
            assert name in read, f"{name}: the table says the manual loop applies it, but its path never reads it"
            continue
        function, call = VIA[applied.via]
        assert call in called, f"{name}: {applied.via} is never called on the manual loop's path"
        source = inspect.getsource(function)
        assert re.search(rf"\b(args|self)\.{name}\b", source), f"{name}: {applied.via} does not read it"


def test_every_field_read_on_the_manual_loops_path_is_in_the_table(path):
    for module, tree in path.items():
        unlisted = fields_read(tree) - set(loop_flags.APPLIED)
        assert not unlisted, f"{module} reads {sorted(unlisted)}: add them to loop_flags.APPLIED (or stop reading)"


def _parsed(*argv: str):
    ns, _ = build_parser().parse_known_args(list(argv))
    return ns


@pytest.mark.parametrize("loop", ["accelerate", "trainer"])
def test_defaults_are_never_refused(loop):
    _validate_flags(_parsed("--loop", loop))


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--label_smoothing_factor", "0.1"], "--label_smoothing_factor=0.1: applied only by --loop trainer"),
    (["--train_sampling_strategy", "group_by_length"], "--train_sampling_strategy=group_by_length"),
    (["--dataloader_drop_last"], "--dataloader_drop_last=true"),
    (["--optim", "galore_adamw"], "--optim=galore_adamw: this value is applied only by --loop trainer"),
    (["--lr_scheduler_type", "reduce_lr_on_plateau", "--eval_strategy", "steps"], "--lr_scheduler_type="),
])
def test_refused_in_the_manual_loop_accepted_by_the_trainer(argv, fragment):
    with pytest.raises(loop_flags.UserError, match=re.escape(fragment)):
        _validate_flags(_parsed("--loop", "accelerate", *argv))
    _validate_flags(_parsed("--loop", "trainer", *argv))


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--hub_strategy", "checkpoint"], "--hub_strategy=checkpoint: not applied in either loop (hf_scale pushes once"),
    (["--do_predict"], "--do_predict=true: not applied in either loop (train.py has no prediction stage)"),
    (["--bf16_full_eval"], "--bf16_full_eval=true: not applied in either loop"),
])
@pytest.mark.parametrize("loop", ["accelerate", "trainer"])
def test_flags_applied_in_neither_loop_are_refused_in_both(argv, fragment, loop):
    with pytest.raises(loop_flags.UserError, match=re.escape(fragment)):
        _validate_flags(_parsed("--loop", loop, *argv))


def test_no_effect_flags_and_default_values_pass():
    _validate_flags(_parsed("--loop", "accelerate", "--do_train", "--prediction_loss_only", "--logging_first_step",
                            "--label_smoothing_factor", "0", "--disable_tqdm", "true", "--num_train_epochs", "0.5"))


def test_the_ddp_flags_given_reach_accelerates_ddp_wrapper_and_none_keeps_its_defaults():
    """--ddp_find_unused_parameters false (common in LoRA recipes) and the other --ddp_* flags: the manual loop
    hands what was given to accelerate's DistributedDataParallelKwargs, as the Trainer does."""
    from accelerate.utils import DistributedDataParallelKwargs

    from hf_scale.train.loops.manual import ddp_kwargs_handlers

    args = _parsed("--loop", "accelerate", "--ddp_find_unused_parameters", "false", "--ddp_bucket_cap_mb", "50",
                   "--ddp_static_graph", "true")
    _validate_flags(args)
    (handler,) = ddp_kwargs_handlers(args)
    assert isinstance(handler, DistributedDataParallelKwargs)
    assert handler.to_kwargs() == {"bucket_cap_mb": 50, "static_graph": True}  # find_unused False: the default
    assert ddp_kwargs_handlers(_parsed("--loop", "accelerate", "--ddp_find_unused_parameters", "true"))[0].to_kwargs() \
        == {"find_unused_parameters": True}
    assert ddp_kwargs_handlers(_parsed("--loop", "accelerate")) == []


def test_fractional_epochs_count_as_in_the_trainer():
    from types import SimpleNamespace

    from hf_scale.contract import launch_values
    from hf_scale.train.loops.manual import _Length

    args = SimpleNamespace(max_steps=-1, num_train_epochs=0.5)
    length = _Length.of(loader_batches=20, num_processes=2, accumulation=2, args=args)
    values = launch_values.TrainingValues(world_size=2, per_device_train_batch_size=1, gradient_accumulation_steps=2)
    assert length.total_steps == launch_values.planned_optimizer_steps(20, values, 0.5) == 3  # not a whole epoch (5)


def test_disable_tqdm_turns_the_manual_loops_bars_off(tmp_path, capfd):
    """One in-process run past validation under --loop accelerate, with an applied flag that is not the default."""
    from train_helpers import run_in_process

    argv = ["--max_steps", "2", "--loop", "accelerate", "--disable_tqdm", "true", "--eval_strategy", "steps",
            "--eval_steps", "1", "--validation_split_percentage", "10", "--output_dir", str(tmp_path / "out")]
    capfd.readouterr()
    assert run_in_process(argv) == 0
    err = capfd.readouterr().err
    assert "training:" not in err and "evaluating:" not in err, err[-2000:]
    assert (tmp_path / "out" / "train_summary.json").is_file()
