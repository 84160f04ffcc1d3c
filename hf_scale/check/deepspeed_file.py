"""Checks of which DeepSpeed JSON the launch reads: where the YAML's `deepspeed_config_file` resolves, two
places naming different files, a JSON nothing enables, YAML keys accelerate refuses next to a JSON.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from hf_scale.check.findings import ERROR, WARNING, Finding, in_file
from hf_scale.check.inputs import CheckInputs, is_deepspeed_yaml
from hf_scale.files.reading import MISSING, get_path
from hf_scale.knowledge.library_tables import DS_FILE_CONFLICTING_YAML_KEYS, YAML_TO_DS_PATH


def check_deepspeed_file_reference(inp: CheckInputs) -> Iterator[Finding]:
    """`deepspeed-config-path`, `deepspeed-config-differs`: the YAML's `deepspeed_config_file` resolves
    only from one directory, or different places name different DeepSpeed JSON files."""
    key = "deepspeed_config.deepspeed_config_file"
    written = get_path(inp.accelerate, key, None)
    if inp.deepspeed_path_note == "yaml_dir_only":
        yield Finding(
            ERROR,
            "deepspeed-config-path",
            inp.accelerate_file,
            key,
            f"`{written}` exists next to the YAML but not in the current directory, and `accelerate "
            "launch` resolves it relative to the directory it is started from.",
            f"{in_file(inp.accelerate_file)}write `{key}` as an absolute path, or relative to the directory you "
            "launch from.",
            {f"{inp.accelerate_file}:{key}": written},
        )
    elif inp.deepspeed_path_note == "cwd_only":
        yield Finding(
            WARNING,
            "deepspeed-config-path",
            inp.accelerate_file,
            key,
            f"`{written}` resolves only relative to the current directory: "
            "launching from anywhere else fails.",
            f"{in_file(inp.accelerate_file)}write `{key}` as an absolute path, or always launch from this "
            "directory.",
            {f"{inp.accelerate_file}:{key}": written},
        )
    elif inp.deepspeed_path_note == "layout_only":
        root = Path(inp.accelerate_file).parent.parent
        name = Path(inp.accelerate_file).stem
        yield Finding(
            WARNING,
            "deepspeed-config-path",
            inp.accelerate_file,
            key,
            f"`{written}` resolves from {root}/ (where the generated launch scripts start `accelerate launch`), "
            "not from the current directory: `accelerate launch` started here fails.",
            f"Start `accelerate launch` from {root}/ (launch/{name}.accelerate.sh there does), or write `{key}` "
            "as an absolute path.",
            {f"{inp.accelerate_file}:{key}": written},
        )
    refs = inp.deepspeed_refs
    for (where_a, written_a, resolved_a), (where_b, written_b, resolved_b) in zip(
        refs, refs[1:], strict=False
    ):
        if resolved_a != resolved_b:
            # --deepspeed-config only picks what this command checks; the other places are read by the job.
            used_by_job = "--deepspeed-config" not in (where_a, where_b)
            file, flag = where_b.rsplit(":", 1)
            yield Finding(
                ERROR if used_by_job else WARNING,
                "deepspeed-config-differs",
                file,
                flag,
                f"Two DeepSpeed configs are named: {where_a}={written_a!r} and {where_b}={written_b!r}"
                + (
                    " (the job reads both)."
                    if used_by_job
                    else " (the job uses the YAML's; this checked the other)."
                ),
                f"Point {where_a} and {where_b} at the same JSON file.",
                {where_a: written_a, where_b: written_b},
            )


def check_deepspeed_unused(inp: CheckInputs) -> Iterator[Finding]:
    """`deepspeed-config-unused`: a DeepSpeed JSON is given but the launch never enables DeepSpeed."""
    trainer_flag = inp.training is not None and inp.training.get("deepspeed")
    if inp.accelerate_file is None or inp.deepspeed is None or is_deepspeed_yaml(inp) or trainer_flag:
        return
    if inp.runner == "deepspeed":
        return
    dtype = inp.accelerate.get("distributed_type")
    yield Finding(
        WARNING,
        "deepspeed-config-unused",
        inp.accelerate_file,
        "distributed_type",
        f"distributed_type is {dtype!r}, so `accelerate launch` does not use {inp.deepspeed_file}.",
        f"{in_file(inp.accelerate_file)}set `distributed_type: DEEPSPEED` with "
        "`deepspeed_config.deepspeed_config_file`, or pass `--deepspeed FILE` in the training args.",
        {f"{inp.accelerate_file}:distributed_type": dtype},
    )


def check_duplicated_deepspeed_keys(inp: CheckInputs) -> Iterator[Finding]:
    """`ds-key-duplicated`: the YAML sets DeepSpeed keys next to `deepspeed_config_file`, or inline while the
    training args pass `--deepspeed FILE`: accelerate refuses them ("the following accelerate config
    variables will be ignored") at launch, resp. when TrainingArguments builds its DeepSpeed plugin."""
    section = inp.accelerate.get("deepspeed_config")
    if not is_deepspeed_yaml(inp) or not isinstance(section, dict):
        return
    flag_json = "deepspeed_config_file" not in section and bool(inp.training and inp.training.get("deepspeed"))
    if "deepspeed_config_file" not in section and not flag_json:
        return
    for key in DS_FILE_CONFLICTING_YAML_KEYS:
        yaml_key = key if key == "mixed_precision" else f"deepspeed_config.{key}"
        value = get_path(inp.accelerate, yaml_key)
        # launch adds mixed_precision to the conflicting fields whenever the YAML sets it, even to "no".
        if value is MISSING or value is None:
            continue
        values = {f"{inp.accelerate_file}:{yaml_key}": value}
        ds_path = YAML_TO_DS_PATH.get(key, "fp16.enabled / bf16.enabled")
        if inp.deepspeed is not None and key in YAML_TO_DS_PATH:
            values[f"{inp.deepspeed_file}:{ds_path}"] = get_path(inp.deepspeed, ds_path, None)
        yield Finding(
            ERROR,
            "ds-key-duplicated",
            inp.accelerate_file,
            yaml_key,
            (
                "Set in the YAML while the training args pass --deepspeed: accelerate raises when "
                "TrainingArguments builds its DeepSpeed plugin (with a JSON it takes this setting only from it)."
                if flag_json
                else "Set next to `deepspeed_config_file`: accelerate raises at launch (with a JSON file it "
                "takes this setting only from the JSON)."
            ),
            f"Delete `{yaml_key}` from {Path(inp.accelerate_file).name} and set `{ds_path}` in "
            f"{Path(inp.deepspeed_file or 'the DeepSpeed JSON').name}"
            + (", or drop --deepspeed from the training args." if flag_json else "."),
            values,
        )
