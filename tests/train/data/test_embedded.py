"""The shipped tiny Llama and sample dataset: regenerated identically, loadable, usable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_scale.contract.embedded_assets import EMBEDDED_DATA_FILE, EMBEDDED_MODEL_DIR
from hf_scale.train.data.embedded import build_tiny_llama, write_sample_data


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR).eval()


def _json_without_version(path: Path) -> dict:
    # save_pretrained stamps the installed transformers version; only that may differ between
    # the shipped files and a rebuild under another transformers release.
    data = json.loads(path.read_text())
    data.pop("transformers_version", None)
    return data


def test_shipped_model_dir_is_exactly_what_build_tiny_llama_produces(tmp_path):
    build_tiny_llama(tmp_path)
    shipped = sorted(p.name for p in EMBEDDED_MODEL_DIR.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == shipped
    for name in shipped:
        fresh, old = tmp_path / name, EMBEDDED_MODEL_DIR / name
        if name.endswith(".safetensors"):
            fresh_tensors, old_tensors = load_file(fresh), load_file(old)
            assert fresh_tensors.keys() == old_tensors.keys()
            for key, tensor in old_tensors.items():
                assert tensor.dtype == torch.float32, key
                assert torch.equal(fresh_tensors[key], tensor), key
        elif name.endswith(".json"):
            assert _json_without_version(fresh) == _json_without_version(old), name
        else:
            assert fresh.read_bytes() == old.read_bytes(), name


def test_shipped_sample_data_is_exactly_what_write_sample_data_produces(tmp_path):
    write_sample_data(tmp_path / "sample.jsonl")
    assert (tmp_path / "sample.jsonl").read_bytes() == EMBEDDED_DATA_FILE.read_bytes()


def test_model_loads_with_transformers_and_runs_a_forward_pass(model, tokenizer):
    assert model.config.vocab_size % 8 == 0 and model.config.vocab_size >= len(tokenizer)
    assert model.config.max_position_embeddings == 512
    assert not model.config.tie_word_embeddings
    assert model.dtype == torch.float32
    batch = tokenizer(["What is 2 plus 3?", "Reverse 'abc'."], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100))
    assert out.logits.shape == (2, batch["input_ids"].shape[1], model.config.vocab_size)
    # Random init at std 0.02 predicts close to uniformly: loss near ln(vocab_size).
    assert abs(out.loss.item() - torch.log(torch.tensor(float(model.config.vocab_size))).item()) < 0.5


def test_generate_stops_at_max_new_tokens_with_shipped_generation_config(model, tokenizer):
    prompt = tokenizer("hello", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[1] <= prompt["input_ids"].shape[1] + 4
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


@pytest.mark.parametrize("text", ["plain ascii", "héllo wörld", "emoji 🙂 and 漢字", "tabs\tand\nnewlines  "])
def test_tokenizer_is_byte_level_and_round_trips_any_text(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) == 1 + len(text.encode("utf-8"))
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_special_tokens_are_distinct(tokenizer):
    ids = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id]
    assert None not in ids and len(set(ids)) == 4


def test_chat_template_marks_exactly_the_assistant_turns_and_their_eos(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello 🙂"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye!"},
    ]
    out = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert ids[0] == tokenizer.bos_token_id
    assistant = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert assistant == "Hello 🙂</s>Bye!</s>"
    rest = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert "Be brief." in rest and "Hi" in rest and "Hello" not in rest


def test_sample_data_has_varied_lengths_under_the_context_limit(tokenizer):
    rows = [json.loads(line) for line in EMBEDDED_DATA_FILE.read_text().splitlines()]
    assert len(rows) == 256
    assert all(set(row) == {"instruction", "response"} for row in rows)
    lengths = sorted(len(tokenizer(r["instruction"] + r["response"])["input_ids"]) + 1 for r in rows)
    median = lengths[len(lengths) // 2]
    assert lengths[-1] < 400 < 512
    assert median < 64, "most examples should be short"
    assert sum(length > 4 * median for length in lengths) >= 10, "a long tail makes packing worthwhile"
