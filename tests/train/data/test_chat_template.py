"""--chat_template_path: read and compiled by transformers' own Jinja environment before anything runs, set
before tokenization (assistant-only labels through its {% generation %} markers), one-line errors.

Saved with the final model and the checkpoints, and pushed: tests/files/test_hub.py (a real run).
"""

from __future__ import annotations

import json

import datasets
import pytest
from transformers import AutoTokenizer

from hf_scale.contract.data_arguments import DataArguments
from hf_scale.contract.embedded_assets import EMBEDDED_MODEL_DIR
from hf_scale.errors import UserError
from hf_scale.train.data.chat_template import read_chat_template
from hf_scale.train.data.labels import IGNORE_INDEX
from hf_scale.train.data.sources import SourceArguments, prepare_datasets
from hf_scale.train.main import main as train_main

TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ 'A: ' }}{% generation %}{{ m['content'] }}"
    "{{ eos_token }}{% endgeneration %}{% else %}{{ 'U: ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
)


def test_a_template_file_is_read_as_is(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template(str(path)) == TEMPLATE


def test_a_base_tokenizer_with_the_template_masks_all_but_the_assistant(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    tokenizer.chat_template = None
    data_file = tmp_path / "chat.jsonl"
    data_file.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                                  {"role": "assistant", "content": "Yo"}]}) + "\n")
    args = DataArguments(train_file=str(data_file))
    with pytest.raises(UserError, match="tokenizer has no chat_template .*--chat_template_path FILE"):
        prepare_datasets(args, SourceArguments(), tokenizer, seed=0, eval_requested_by=None)
    tokenizer.chat_template = read_chat_template(str(path))  # what train.py does before tokenizing
    row = prepare_datasets(args, SourceArguments(), tokenizer, seed=0, eval_requested_by=None).train[0]
    assert tokenizer.decode(row["input_ids"]) == "U: Hi\nA: Yo" + tokenizer.eos_token
    targets = [t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label != IGNORE_INDEX]
    assert tokenizer.decode(targets) == "Yo" + tokenizer.eos_token


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "--chat_template_path {p}: not found; expected a Jinja chat template file"),
        ("", "--chat_template_path {p}: the file is empty"),
        ("{% for m in messages %}{{ m['content'] }", "--chat_template_path {p}: not a valid Jinja template: "),
        ("{% generation %}{{ x }}", "--chat_template_path {p}: not a valid Jinja template: "),  # no endgeneration
        (b"\xff\xfe{{ x }}", "--chat_template_path {p}: not UTF-8 text (byte 0xff at line 1)"),
    ],
    ids=["missing", "empty", "syntax-error", "unclosed-generation", "not-utf8"],
)
def test_bad_template_is_one_line_exit_2_before_anything_runs(content, message, tmp_path, capsys):
    path = tmp_path / "t.jinja"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--chat_template_path", str(path), "--output_dir", str(out)])
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("train.py: error: " + message.format(p=path)), lines
    assert not out.exists()
