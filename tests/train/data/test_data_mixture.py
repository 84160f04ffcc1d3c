"""Several training sources: per-source format and tokenization, seeded weighted mixing, the manifest of what
was taken, the validation set (own splits, --validation_file, carved) and one-line errors.

That the mixture is identical on every rank and dealt disjointly is proven by
tests/train/loops/test_loops_equivalence.py, whose runs (DDP, ZeRO-1/2/3, FSDP2, both loops) all train on a
two-source weighted mixture and must equal one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

from hf_scale.contract.data_arguments import DataArguments, SourceArguments
from hf_scale.contract.embedded_assets import EMBEDDED_MODEL_DIR
from hf_scale.errors import UserError
from hf_scale.train.data.labels import IGNORE_INDEX
from hf_scale.train.data.sources import data_sources, describe, prepare_datasets


@pytest.fixture(autouse=True)
def datasets_cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets_cache"))


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture
def three_formats(tmp_path):
    """A prompt/response file, a chat file and a plain-text file: one format each."""
    qa_rows = [{"prompt": f"What is {i} plus 1?", "response": str(i + 1)} for i in range(300)]
    prompts = _jsonl(tmp_path / "qa.jsonl", qa_rows)
    chats = _jsonl(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": f"{i}"}]}
        for i in range(100)
    ])
    text = tmp_path / "notes.txt"
    text.write_text("".join(f"note number {i}\n" for i in range(200)))
    return prompts, chats, str(text)


def _kind(labels: list[int], input_ids: list[int]) -> str:
    """Which source a tokenized row came from: text rows train on every token, the others mask the prompt."""
    return "text" if labels == input_ids else "masked"


def _prepare(tokenizer, files, weights=None, seed=7, **extra):
    args = DataArguments(train_file=list(files))
    return prepare_datasets(args, SourceArguments(mixture_weights=weights, **extra), tokenizer, seed=seed,
                            eval_requested_by=None)


def test_each_source_keeps_its_own_format_and_the_concatenation_takes_every_row(tokenizer, three_formats):
    data = _prepare(tokenizer, three_formats)
    manifest = data.manifest
    assert manifest["mixing"] == "concatenate"
    assert [s["examples_taken"] for s in manifest["sources"]] == [300, 100, 200] == [s["examples"] for s in
                                                                                     manifest["sources"]]
    assert len(data.train) == 600 and data.train.column_names == ["input_ids", "labels"]
    kinds = [_kind(r["labels"], r["input_ids"]) for r in data.train]
    assert kinds.count("text") == 200 and kinds.count("masked") == 400
    # Chat rows were rendered by the chat template (its role marker), prompt/response rows were not.
    decoded = [tokenizer.decode(r["input_ids"]) for r in data.train.select(range(300, 400))]
    assert all("<|user|>" in text for text in decoded)


def test_weights_draw_each_sources_share_seeded_and_recorded(tokenizer, three_formats):
    prompts, _, text = three_formats
    data = _prepare(tokenizer, [prompts, text], weights=[3, 1])
    manifest = data.manifest
    assert manifest["mixing"] == "interleave" and manifest["stopping_strategy"] == "first_exhausted"
    assert [s["weight"] for s in manifest["sources"]] == [0.75, 0.25]
    taken = [s["examples_taken"] for s in manifest["sources"]]
    # first_exhausted: stops when the first source runs out; each row at most once; about 3:1.
    assert taken[0] == 300 or taken[1] == 200
    assert 2.4 < taken[0] / taken[1] < 3.8 and sum(taken) == len(data.train) == manifest["train_examples"]
    kinds = [_kind(r["labels"], r["input_ids"]) for r in data.train]
    assert kinds.count("masked") == taken[0] and kinds.count("text") == taken[1]
    # Deterministic: the same seed gives the same rows in the same order; another seed another order.
    again = _prepare(tokenizer, [prompts, text], weights=[3, 1])
    assert again.train["input_ids"] == data.train["input_ids"]
    other = _prepare(tokenizer, [prompts, text], weights=[3, 1], seed=8)
    assert other.train["input_ids"] != data.train["input_ids"]
    assert describe(manifest).startswith(f"hf_scale: data mixture (interleave): {prompts} weight 0.75: ")


def test_all_exhausted_repeats_the_small_source_until_every_row_was_used(tokenizer, three_formats):
    prompts, chats, _ = three_formats
    data = _prepare(tokenizer, [prompts, chats], weights=[0.5, 0.5], mixture_stopping_strategy="all_exhausted")
    taken = [s["examples_taken"] for s in data.manifest["sources"]]
    assert taken[0] >= 300 and taken[1] > 100  # the chat file (100 rows) is oversampled to keep its half


def test_validation_is_carved_per_source_tokenized_alike_and_capped(tokenizer, three_formats):
    prompts, _, text = three_formats
    args = DataArguments(train_file=[prompts, text])
    extra = SourceArguments(validation_split_percentage=10, max_eval_samples=45)
    data = prepare_datasets(args, extra, tokenizer, seed=7, eval_requested_by="--eval_strategy steps")
    assert [s["examples"] for s in data.manifest["sources"]] == [270, 180]
    assert len(data.validation) == 45 and data.validation.column_names == ["input_ids", "labels"]
    # Carved rows are not trained on.
    assert not {tuple(r) for r in data.validation["input_ids"]} & {tuple(r) for r in data.train["input_ids"]}
    full = prepare_datasets(args, SourceArguments(validation_split_percentage=10), tokenizer, seed=7,
                            eval_requested_by="--do_eval")
    assert len(full.validation) == 30 + 20
    not_asked = prepare_datasets(args, SourceArguments(validation_split_percentage=10), tokenizer, seed=7,
                                 eval_requested_by=None)
    assert not_asked.validation is None and not_asked.unused_validation


def test_validation_file_and_a_datasets_own_split(tokenizer, tmp_path, three_formats):
    prompts, _, _ = three_formats
    validation = _jsonl(tmp_path / "val.jsonl", [{"text": "held out"}] * 3)
    data = prepare_datasets(DataArguments(train_file=prompts, validation_file=validation), SourceArguments(),
                            tokenizer, seed=1, eval_requested_by="--do_eval")
    assert len(data.validation) == 3
    directory = tmp_path / "ds"
    directory.mkdir()
    _jsonl(directory / "train.jsonl", [{"text": f"row {i}"} for i in range(8)])
    _jsonl(directory / "validation.jsonl", [{"text": "val"}] * 2)
    data = prepare_datasets(DataArguments(dataset_name=str(directory)), SourceArguments(), tokenizer, seed=1,
                            eval_requested_by="--eval_strategy epoch")
    assert len(data.validation) == 2 and len(data.train) == 8


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(UserError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("files", "extra", "message"),
    [
        (["a.jsonl", "b.jsonl"], {"mixture_weights": [1.0]},
         "--mixture_weights 1: 1 weights for 2 --train_file sources; give one weight per source, in the same order"),
        (["a.jsonl", "b.jsonl"], {"mixture_weights": [1.0, -2.0]},
         "--mixture_weights 1 -2: -2 is not a positive number"),
        (["a.jsonl", "b.jsonl"], {"mixture_weights": [1.0, float("nan")]}, "nan is not a positive number"),
        (["a.jsonl"], {"mixture_weights": [1.0]}, "--mixture_weights 1: needs several --train_file or --dataset_name"),
        (["a.jsonl"], {"validation_split_percentage": 100.0},
         "--validation_split_percentage 100: must be between 0 and 100 (exclusive)"),
        (["a.jsonl"], {"max_eval_samples": 0}, "--max_eval_samples 0: must be a positive number of examples"),
    ],
    ids=["weight-count", "negative-weight", "nan-weight", "weights-for-one-source", "percentage-range",
         "max-eval-samples"],
)
def test_bad_mixture_flags_are_one_line(files, extra, message):
    assert message in _error(data_sources, DataArguments(train_file=files), SourceArguments(**extra))


def test_flag_combinations_that_contradict_each_other():
    assert "mutually exclusive" in _error(
        data_sources, DataArguments(dataset_name="d", train_file="a.jsonl"), SourceArguments())
    assert "pass one" in _error(
        data_sources, DataArguments(train_file="a.jsonl", validation_file="v.jsonl"),
        SourceArguments(validation_split_percentage=5.0))
    assert _error(data_sources, DataArguments(train_file="a.jsonl"), SourceArguments(), "--eval_strategy steps") == (
        "--eval_strategy steps: there is no validation data; pass --validation_file, a --dataset_name with a "
        "validation split, or --validation_split_percentage N to carve one from the training data")


def test_an_error_in_one_source_names_that_source(tokenizer, tmp_path, three_formats):
    prompts, _, _ = three_formats
    odd = _jsonl(tmp_path / "odd.jsonl", [{"body": "no known column"}])
    message = _error(_prepare, tokenizer, [prompts, odd])
    assert message.startswith(f"--train_file {odd}: cannot tell the dataset format from its columns (body)")
    missing = str(tmp_path / "missing.jsonl")
    assert _error(_prepare, tokenizer, [prompts, missing]).startswith(f"--train_file {missing}: no such file; ")
    # A validation file is read, and so checked, even when nothing asks for evaluation.
    assert _error(prepare_datasets, DataArguments(train_file=prompts, validation_file=missing), SourceArguments(),
                  tokenizer, seed=1, eval_requested_by=None).startswith(f"--validation_file {missing}: no such file")


def test_a_dataset_without_validation_split_cannot_be_evaluated(tokenizer, tmp_path):
    directory = tmp_path / "ds"
    directory.mkdir()
    _jsonl(directory / "train.jsonl", [{"text": f"row {i}"} for i in range(4)])
    message = _error(prepare_datasets, DataArguments(dataset_name=str(directory)), SourceArguments(), tokenizer,
                     seed=1, eval_requested_by="--do_eval")
    assert message.startswith("--do_eval: there is no validation data")


def test_chat_rows_need_the_generation_markers_for_completion_only_loss(tmp_path, three_formats):
    _, chats, _ = three_formats
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    message = _error(_prepare, tokenizer, [chats])
    assert "{% generation %}" in message and "--chat_template_path FILE" in message
    assert IGNORE_INDEX == -100
