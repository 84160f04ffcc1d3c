"""The data pipeline: formats, masking, truncation, collators (packing: tests/train/data/test_packing.py),
rank-aware shuffling in a real 2-process run, and one-line errors for bad input."""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from paths import REPO
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, TrainingArguments

from hf_scale.contract.data_arguments import DataArguments, check_max_seq_length
from hf_scale.contract.embedded_assets import EMBEDDED_DATA_FILE, EMBEDDED_MODEL_DIR
from hf_scale.errors import UserError
from hf_scale.train.data.batches import count_target_tokens, make_collator, make_train_dataloader
from hf_scale.train.data.formats import detect_format
from hf_scale.train.data.labels import IGNORE_INDEX
from hf_scale.train.data.pipeline import load_raw_datasets, tokenize_dataset

PROMPT_ROWS = [
    {"prompt": "What is 2 plus 3?", "response": "5"},
    {"prompt": "Reverse 'abc'.", "response": "cba"},
    {"prompt": "Say hello in French.", "response": "Bonjour 🙂"},
]
TEXT_ROWS = [{"text": "The cat sat."}, {"text": "A much longer line of plain text, ünïcode included."}]
CHATS = [
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
    ],
]


@pytest.fixture(autouse=True)
def datasets_cache_in_tmp(tmp_path, monkeypatch):
    # Keep the Arrow caches of these throwaway files out of the user's ~/.cache.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets_cache"))


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)


def write_rows(path: Path, rows: list[dict]) -> Path:
    """Write rows in the format the extension names, with each format's own writer."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif path.suffix == ".parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif path.suffix == ".txt":
        path.write_text("".join(row["text"] + "\n" for row in rows))
    return path


def tokenized(tokenizer, path: Path, **kwargs) -> datasets.Dataset:
    args = DataArguments(train_file=str(path), **kwargs)
    return tokenize_dataset(load_raw_datasets(args)["train"], tokenizer, args)


def targets(example) -> list[int]:
    return [label for label in example["labels"] if label != IGNORE_INDEX]


# --- formats -------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".txt", ".csv", ".jsonl"])
def test_plain_text_trains_on_every_token_and_ends_with_eos(tmp_path, tokenizer, suffix):
    ds = tokenized(tokenizer, write_rows(tmp_path / f"data{suffix}", TEXT_ROWS))
    assert ds.column_names == ["input_ids", "labels"]
    assert len(ds) == len(TEXT_ROWS)
    for example, row in zip(ds, TEXT_ROWS, strict=True):
        assert example["input_ids"][0] == tokenizer.bos_token_id
        assert example["input_ids"][-1] == tokenizer.eos_token_id
        assert example["labels"] == example["input_ids"]
        assert tokenizer.decode(example["input_ids"], skip_special_tokens=True) == row["text"]


@pytest.mark.parametrize(
    ("suffix", "prompt_key", "response_key"),
    [
        (".jsonl", "instruction", "response"),
        (".json", "prompt", "completion"),
        (".csv", "prompt", "completion"),
        (".parquet", "question", "answer"),
    ],
)
def test_prompt_response_masks_exactly_the_prompt_tokens(tmp_path, tokenizer, suffix, prompt_key,
                                                         response_key):
    rows = [{prompt_key: r["prompt"], response_key: r["response"]} for r in PROMPT_ROWS]
    ds = tokenized(tokenizer, write_rows(tmp_path / f"data{suffix}", rows))
    assert len(ds) == len(rows)
    for example, row in zip(ds, rows, strict=True):
        prompt_len = len(tokenizer(row[prompt_key])["input_ids"])
        assert example["labels"][:prompt_len] == [IGNORE_INDEX] * prompt_len
        assert example["labels"][prompt_len:] == example["input_ids"][prompt_len:]
        assert tokenizer.decode(targets(example)) == row[response_key] + tokenizer.eos_token
        assert tokenizer.decode(example["input_ids"]) == (
            tokenizer.bos_token + row[prompt_key] + row[response_key] + tokenizer.eos_token
        )


def test_prompt_response_without_completion_only_loss_trains_on_every_token(tmp_path, tokenizer):
    ds = tokenized(tokenizer, write_rows(tmp_path / "d.jsonl", PROMPT_ROWS), completion_only_loss=False)
    assert all(example["labels"] == example["input_ids"] for example in ds)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_chat_messages_train_only_on_assistant_turns(tmp_path, tokenizer, suffix):
    rows = [{"messages": chat, "id": i} for i, chat in enumerate(CHATS)]
    ds = tokenized(tokenizer, write_rows(tmp_path / f"chat{suffix}", rows))
    assert ds.column_names == ["input_ids", "labels"]
    for example, chat in zip(ds, CHATS, strict=True):
        assert example["input_ids"] == tokenizer.apply_chat_template(chat, return_dict=True)["input_ids"]
        expected = "".join(m["content"] + tokenizer.eos_token for m in chat if m["role"] == "assistant")
        assert tokenizer.decode(targets(example)) == expected
        assert all(label in (IGNORE_INDEX, token) for label, token in
                   zip(example["labels"], example["input_ids"], strict=True))


def test_chat_messages_without_completion_only_loss_train_on_the_whole_conversation(tmp_path, tokenizer):
    path = write_rows(tmp_path / "chat.jsonl", [{"messages": chat} for chat in CHATS])
    ds = tokenized(tokenizer, path, completion_only_loss=False)
    assert all(example["labels"] == example["input_ids"] for example in ds)


def test_embedded_sample_is_the_default_dataset(tokenizer):
    args = DataArguments()
    raw = load_raw_datasets(args)
    assert list(raw) == ["train"]
    assert len(raw["train"]) == 256
    assert detect_format(raw["train"].column_names, args) == "prompt_response"
    assert len(tokenize_dataset(raw["train"], tokenizer, args)) == 256


def test_validation_file_becomes_the_validation_split(tmp_path):
    train = write_rows(tmp_path / "train.jsonl", PROMPT_ROWS)
    validation = write_rows(tmp_path / "val.csv", PROMPT_ROWS[:2])
    raw = load_raw_datasets(DataArguments(train_file=str(train), validation_file=str(validation)))
    assert {split: len(ds) for split, ds in raw.items()} == {"train": 3, "validation": 2}


def test_dataset_name_loads_a_local_dataset_directory_with_its_splits(tmp_path):
    write_rows(tmp_path / "train.jsonl", PROMPT_ROWS)
    write_rows(tmp_path / "validation.jsonl", PROMPT_ROWS[:1])
    raw = load_raw_datasets(DataArguments(dataset_name=str(tmp_path)))
    assert {split: len(ds) for split, ds in raw.items()} == {"train": 3, "validation": 1}


def test_max_train_samples_keeps_the_first_examples():
    raw = load_raw_datasets(DataArguments(max_train_samples=10))
    first = [json.loads(line) for line in EMBEDDED_DATA_FILE.read_text().splitlines()[:10]]
    assert raw["train"].to_list() == first


@pytest.mark.parametrize(
    ("columns", "flags", "expected"),
    [
        (["text", "id"], {}, "text"),
        (["instruction", "response"], {}, "prompt_response"),
        (["question", "answer", "text"], {}, "prompt_response"),
        (["prompt", "response"], {}, "prompt_response"),
        (["messages", "text"], {}, "messages"),
        (["body", "id"], {"text_column": "body"}, "text"),
        (["q", "a"], {"prompt_column": "q", "response_column": "a"}, "prompt_response"),
        (["q", "response"], {"prompt_column": "q"}, "prompt_response"),
        (["conv", "text"], {"messages_column": "conv"}, "messages"),
    ],
)
def test_format_is_detected_from_columns_or_given_by_flags(columns, flags, expected):
    assert detect_format(columns, DataArguments(**flags)) == expected


def test_data_flags_parse_alongside_every_training_argument():
    parser = HfArgumentParser((DataArguments, TrainingArguments))  # a clashing flag name would raise here
    data_args, _ = parser.parse_args_into_dataclasses(
        ["--output_dir", "out", "--train_file", "d.csv", "--packing", "--completion_only_loss", "false",
         "--max_seq_length", "128"]
    )
    assert data_args.train_file == ["d.csv"] and data_args.max_seq_length == 128
    assert data_args.packing is True and data_args.completion_only_loss is False
    assert parser.parse_args_into_dataclasses(["--output_dir", "out"])[0].completion_only_loss is None


# --- truncation and the tokenization cache -------------------------------------------------------


def test_truncation_cuts_to_max_seq_length_and_drops_examples_left_without_targets(tmp_path, tokenizer,
                                                                                   caplog):
    rows = [
        {"prompt": "short", "response": "fine"},
        {"prompt": "x" * 40, "response": "never seen"},  # the prompt alone fills the window
        {"prompt": "ab", "response": "a response longer than the window"},
    ]
    with caplog.at_level(logging.WARNING, logger="hf_scale.train.data.pipeline"):
        ds = tokenized(tokenizer, write_rows(tmp_path / "d.jsonl", rows), max_seq_length=16)
    assert len(ds) == 2
    assert [len(example["input_ids"]) for example in ds] == [1 + 5 + 4 + 1, 16]
    assert tokenizer.decode(targets(ds[1])) == "a response lo"
    assert "dropped 1 of 3 examples" in caplog.text


def test_tokenization_is_cached_under_a_fingerprint_that_only_output_relevant_flags_change(tmp_path):
    path = write_rows(tmp_path / "d.jsonl", PROMPT_ROWS)
    # Fresh tokenizer objects each time: the fingerprint must hash their content, not their identity.
    first = tokenized(AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR), path)
    again = tokenized(AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR), path, packing=True)
    shorter = tokenized(AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR), path, max_seq_length=30)
    assert first._fingerprint == again._fingerprint != shorter._fingerprint
    assert first.cache_files == again.cache_files
    assert Path(first.cache_files[0]["filename"]).is_relative_to(tmp_path)


# --- collators and token counts ------------------------------------------------------------------


@pytest.fixture(scope="module")
def sample_examples(tokenizer):
    """Four embedded-sample examples of very different lengths (one from the long tail)."""
    args = DataArguments()
    ds = tokenize_dataset(load_raw_datasets(args)["train"], tokenizer, args)
    by_length = sorted(range(len(ds)), key=lambda i: len(ds[i]["input_ids"]))
    return [ds[i] for i in (by_length[0], by_length[100], by_length[200], by_length[-1])]


def test_padded_batch_pads_inputs_and_ignores_padded_labels(tokenizer, sample_examples):
    batch = make_collator(tokenizer, packing=False)(sample_examples)
    lengths = [len(example["input_ids"]) for example in sample_examples]
    assert batch["input_ids"].shape == batch["labels"].shape == (4, max(lengths))
    for row, (example, length) in enumerate(zip(sample_examples, lengths, strict=True)):
        assert batch["attention_mask"][row].tolist() == [1] * length + [0] * (max(lengths) - length)
        assert batch["input_ids"][row, :length].tolist() == example["input_ids"]
        assert (batch["input_ids"][row, length:] == tokenizer.pad_token_id).all()
        assert batch["labels"][row].tolist() == example["labels"] + [IGNORE_INDEX] * (max(lengths) - length)


def test_collator_falls_back_to_eos_for_padding_when_the_tokenizer_has_no_pad_token(sample_examples):
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    tokenizer.pad_token = None
    batch = make_collator(tokenizer, packing=False)(sample_examples[:2])
    assert tokenizer.pad_token == tokenizer.eos_token
    assert batch["input_ids"][0, -1] == tokenizer.eos_token_id  # the shorter row is padded


def _model(attn_implementation: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, attn_implementation=attn_implementation)
    # As in training (the Trainer's default, hf_scale's model loading): with a KV cache transformers
    # does not look for packed sequences in position_ids. See make_collator's docstring.
    model.config.use_cache = False
    return model.eval()


def test_count_target_tokens_is_what_the_causal_lm_loss_averages_over(tokenizer, sample_examples):
    # Packed rows: tests/train/data/test_packing.py.
    batch = make_collator(tokenizer, packing=False)(sample_examples)
    model = _model("sdpa")
    with torch.no_grad():
        mean = model(**batch).loss
        normalized = model(**batch, num_items_in_batch=torch.tensor(count_target_tokens(batch))).loss
    torch.testing.assert_close(normalized, mean, rtol=1e-6, atol=0)
    assert count_target_tokens(batch) == sum(len(targets(e)) - (e["labels"][0] != IGNORE_INDEX)
                                             for e in sample_examples)


# --- shuffling and sharding ----------------------------------------------------------------------


def test_train_dataloader_shuffles_reproducibly_from_its_seed_and_keeps_the_tail(tokenizer):
    n = 11
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 10 + i, 2] for i in range(n)],
                                     "labels": [[1, 10 + i, 2] for i in range(n)]})
    collator = make_collator(tokenizer, packing=False)

    def order(seed):
        batches = make_train_dataloader(ds, collator, 4, seed)
        return [row[1].item() for batch in batches for row in batch["input_ids"]]

    assert sorted(order(0)) == [10 + i for i in range(n)]  # drop_last=False: the short last batch stays
    assert order(0) == order(0)
    assert order(0) != order(1)
    assert [len(batch["input_ids"]) for batch in make_train_dataloader(ds, collator, 4, 0)] == [4, 4, 3]


@pytest.mark.multiprocess
def test_two_ranks_see_disjoint_samples_covering_the_epoch_and_reshuffle_each_epoch(tmp_path):
    n_samples, micro, ranks = 21, 2, 2
    train_file = tmp_path / "ids.txt"
    train_file.write_text("".join(f"sample {i}\n" for i in range(n_samples)))
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
         str(REPO / "tests" / "_rank_data_worker.py"), "--train_file", str(train_file), "--out", str(out),
         "--micro_batch_size", str(micro), "--seed", "7"],
        check=True, env=env, cwd=tmp_path, timeout=300,
    )
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    assert [r["num_processes"] for r in records] == [ranks, ranks]

    # accelerate's even_batches: the epoch is padded to whole micro-batches on every rank with the
    # first samples of the same epoch's order.
    padded_total = math.ceil(n_samples / (ranks * micro)) * ranks * micro
    pad = padded_total - n_samples
    orders = []
    for epoch in ("0", "1"):
        per_rank = [r["epochs"][epoch] for r in records]
        assert len(per_rank[0]) == len(per_rank[1]) == padded_total // (ranks * micro)
        assert all(len(batch) == micro for batches in per_rank for batch in batches)
        # Micro-batch k of rank r is the (k * ranks + r)-th micro-batch of the epoch's global order.
        order = [i for step in zip(*per_rank, strict=True) for batch in step for i in batch]
        assert sorted(order[:n_samples]) == list(range(n_samples)), "every sample exactly once"
        assert order[n_samples:] == order[:pad], "only the documented tail padding repeats"
        seen = [{i for batch in batches for i in batch} for batches in per_rank]
        assert seen[0] & seen[1] <= set(order[:pad]), "ranks are disjoint apart from the tail padding"
        orders.append(order)
    assert orders[0] != orders[1], "the order changes with the epoch"


# --- bad input -----------------------------------------------------------------------------------


def _error(fn, *args) -> str:
    with pytest.raises(UserError) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_file_is_a_one_line_error(tmp_path):
    message = _error(load_raw_datasets, DataArguments(train_file=str(tmp_path / "nope.jsonl")))
    assert message == (f"--train_file {tmp_path / 'nope.jsonl'}: no such file; expected a data file (.json, .jsonl, "
                       ".csv, .parquet, .txt)")


def test_unsupported_extension_is_a_one_line_error_listing_the_allowed_ones(tmp_path):
    path = tmp_path / "data.xml"
    path.write_text("<rows/>")
    message = _error(load_raw_datasets, DataArguments(train_file=str(path)))
    assert "unsupported extension '.xml'; allowed: .json, .jsonl, .csv, .parquet, .txt" in message


@pytest.mark.parametrize("content", ["", "[]", "\n\n"])
def test_empty_dataset_is_a_one_line_error(tmp_path, content):
    path = tmp_path / "empty.json"
    path.write_text(content)
    assert "the dataset is empty" in _error(load_raw_datasets, DataArguments(train_file=str(path)))


def test_csv_with_only_a_header_is_an_empty_dataset(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("prompt,response\n")
    assert "the dataset is empty" in _error(load_raw_datasets, DataArguments(train_file=str(path)))


def test_malformed_json_is_a_one_line_error_with_the_parser_message(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"\n')
    message = _error(load_raw_datasets, DataArguments(train_file=str(path)))
    assert message.startswith(f"--train_file {path}: could not be read as json: ")


def test_unknown_column_is_named_with_the_available_ones(tmp_path, tokenizer):
    args = DataArguments(train_file=str(write_rows(tmp_path / "d.jsonl", PROMPT_ROWS)), text_column="body")
    raw = load_raw_datasets(args)["train"]
    message = _error(tokenize_dataset, raw, tokenizer, args)
    assert message == "--text_column body: no such column; available: prompt, response"


def test_undetectable_format_asks_for_column_flags():
    message = _error(detect_format, ["a", "b"], DataArguments())
    assert "cannot tell the dataset format from its columns (a, b)" in message


def test_columns_of_two_formats_are_an_error():
    args = DataArguments(text_column="text", messages_column="messages")
    message = _error(detect_format, ["text", "messages"], args)
    assert "--text_column text, --messages_column messages: these select different dataset formats" in message


def test_completion_only_loss_on_plain_text_is_an_error(tmp_path, tokenizer):
    args = DataArguments(train_file=str(write_rows(tmp_path / "d.txt", TEXT_ROWS)), completion_only_loss=True)
    message = _error(tokenize_dataset, load_raw_datasets(args)["train"], tokenizer, args)
    assert message.startswith("--completion_only_loss true: the dataset is plain text")


def test_completion_only_chat_needs_generation_markers_in_the_template(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    args = DataArguments(train_file=str(write_rows(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS])))
    message = _error(tokenize_dataset, load_raw_datasets(args)["train"], tokenizer, args)
    assert "chat template has no {% generation %} block" in message


def test_non_positive_max_train_samples_is_an_error():
    message = _error(load_raw_datasets, DataArguments(max_train_samples=0))
    assert message == "--max_train_samples 0: must be a positive number of examples"


def test_dataset_name_and_train_file_together_are_an_error(tmp_path):
    message = _error(load_raw_datasets, DataArguments(dataset_name=str(tmp_path), train_file="x.jsonl"))
    assert "mutually exclusive" in message


def test_unknown_split_lists_the_available_ones(tmp_path):
    write_rows(tmp_path / "train.jsonl", PROMPT_ROWS)
    message = _error(load_raw_datasets, DataArguments(dataset_name=str(tmp_path), train_split="dev"))
    assert message == f"--train_split dev: no such split in {tmp_path}; available: train"


def test_no_example_left_after_truncation_is_an_error(tmp_path, tokenizer):
    args = DataArguments(train_file=str(write_rows(tmp_path / "d.jsonl", PROMPT_ROWS)), max_seq_length=3)
    message = _error(tokenize_dataset, load_raw_datasets(args)["train"], tokenizer, args)
    assert message == "--max_seq_length 3: no example has a target token left after truncation"


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (513, "--max_seq_length 513 is above the model's max_position_embeddings 512; use at most 512"),
        (0, "--max_seq_length 0: must be a positive number of tokens"),
        (-4, "--max_seq_length -4: must be a positive number of tokens"),
    ],
)
def test_max_seq_length_outside_the_model_range_is_an_error(length, expected):
    config = AutoConfig.from_pretrained(EMBEDDED_MODEL_DIR)
    assert _error(check_max_seq_length, length, config) == expected
    check_max_seq_length(512, config)
