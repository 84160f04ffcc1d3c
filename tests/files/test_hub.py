"""--push_to_hub from training and `hf-scale export --push-to-hub`, against a local stand-in of the Hub
(tests/hub_standin.py: huggingface_hub's real client over HTTP; never the network).

One single-process run covers a whole chat fine-tune as a user would start it: the starter recipe of
`hf-scale generate --recipe`, a base tokenizer without a chat template plus --chat_template_path, and
--push_to_hub. Its checkpoint is then exported and pushed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hub_standin import TOKEN, USER, HubStandIn
from train_helpers import TRAIN_PY, child_env, run, run_ok
from transformers import AutoTokenizer

from hf_scale.commands.cli import main as cli_main
from hf_scale.contract.embedded_assets import EMBEDDED_MODEL_DIR

TEMPLATE = (
    "{# hf_scale test template #}{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{{ 'A: ' }}{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ 'U: ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
)
CHATS = [
    {"messages": [{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": str(2 * i)}]}
    for i in range(40)
]


@pytest.fixture(scope="module")
def hub():
    with HubStandIn() as server:
        yield server


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, hub):
    root = tmp_path_factory.mktemp("chat")
    base_tokenizer = root / "base-tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    tokenizer.chat_template = None  # a base model's tokenizer: no chat template
    tokenizer.save_pretrained(base_tokenizer)
    assert not (base_tokenizer / "chat_template.jinja").exists()
    (root / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in CHATS))
    (root / "template.jinja").write_text(TEMPLATE)
    assert cli_main(["generate", "--preset", "single_gpu", "--name", "chat", "--set", "precision='no'", "--recipe",
                     "--output-dir", str(root)]) == 0
    out = root / "out"
    result = run_ok(
        [sys.executable, TRAIN_PY, str(root / "recipes" / "chat.yaml"), "--train_file", str(root / "chat.jsonl"),
         "--tokenizer_name_or_path", str(base_tokenizer), "--chat_template_path", str(root / "template.jinja"),
         "--max_steps", "2", "--save_steps", "2", "--learning_rate", "1e-3", "--output_dir", str(out),
         "--push_to_hub", "--hub_model_id", f"{USER}/chat-model"],
        env=hub.env(child_env()), timeout=400,
    )
    return out, result


def test_training_pushes_the_verified_model_once_without_checkpoints(chat_run, hub):
    out, result = chat_run
    assert [repo for repo, _, _ in hub.commits].count(f"{USER}/chat-model") == 1  # not the Trainer's pushes too
    files = hub.repos[f"{USER}/chat-model"]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json", "train_summary.json", "hf_scale_verify.json"):
        assert name in files, sorted(files)
    assert not [name for name in files if name.startswith("checkpoint-") or name.endswith("hf_scale_verify.pt")]
    assert files["model.safetensors"] == (out / "model.safetensors").read_bytes()
    assert json.loads(files["hf_scale_verify.json"])["ok"] is True
    assert not hub.unexpected
    assert f"pushed to {hub.url}/{USER}/chat-model/commit/" in result.stderr


def test_the_chat_template_is_applied_and_saved_with_the_model_and_its_checkpoints(chat_run, hub):
    out, _ = chat_run
    for directory in (out, out / "checkpoint-2"):
        assert (directory / "chat_template.jinja").read_text() == TEMPLATE
        assert AutoTokenizer.from_pretrained(directory).chat_template == TEMPLATE
    assert hub.repos[f"{USER}/chat-model"]["chat_template.jinja"].decode() == TEMPLATE
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["recipe"].endswith("recipes/chat.yaml") and summary["saved_model_verified"]


def test_export_pushes_the_exported_directory(chat_run, hub, tmp_path):
    out, _ = chat_run
    exported = tmp_path / "exported"
    result = run_ok([sys.executable, "-m", "hf_scale", "export", str(out / "checkpoint-2"), str(exported),
                     "--push-to-hub", "exported-model"], env=hub.env(child_env()), timeout=300)
    repo = f"{USER}/exported-model"  # no namespace given: the token's user, as on the Hub
    assert repo in hub.repos and "done" in result.stderr
    pushed = hub.repos[repo]
    assert sorted(pushed) == sorted(p.name for p in exported.iterdir())
    assert pushed["model.safetensors"] == (exported / "model.safetensors").read_bytes()
    assert pushed["chat_template.jinja"].decode() == TEMPLATE
    assert not hub.unexpected


@pytest.mark.parametrize(
    ("env", "flags", "message"),
    [
        ({"HF_HUB_OFFLINE": "1"}, ["--push_to_hub"], "the Hub is switched off here"),
        ({}, ["--push_to_hub", "--hub_model_id", "a/b/c"], "--push_to_hub a/b/c: not a Hub repository id"),
        ({"HF_TOKEN": None}, ["--push_to_hub", "--hub_model_id", "me/x"], "--push_to_hub me/x: no Hub token"),
    ],
    ids=["offline", "bad-repo-id", "no-token"],
)
def test_training_push_bad_input_is_one_line_before_anything_runs(env, flags, message, tmp_path, monkeypatch,
                                                                  capsys):
    from hf_scale.train.main import main as train_main

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no saved login
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        train_main([*flags, "--output_dir", str(out)])
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], lines
    assert not out.exists()


def test_a_refused_token_stops_training_before_the_first_step(hub, tmp_path):
    out = tmp_path / "out"
    env = hub.env(child_env()) | {"HF_TOKEN": "hf_wrong"}
    result = run([sys.executable, TRAIN_PY, "--push_to_hub", "--hub_model_id", "me/x", "--max_steps", "1",
                  "--output_dir", str(out)], env=env, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("train.py: error:")]
    assert len(errors) == 1 and "--push_to_hub me/x: the Hub refused or could not be reached" in errors[0]
    assert not (out / "metrics.jsonl").exists() and not (out / "model.safetensors").exists()


def test_export_push_bad_input_writes_nothing(tmp_path):
    out = tmp_path / "out"
    result = run([sys.executable, "-m", "hf_scale", "export", str(tmp_path / "missing"), str(out),
                  "--push-to-hub", "bad id!"], env=child_env(), timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        result.stderr.strip().splitlines()[0]] and "--push-to-hub bad id!: not a Hub repository id" in result.stderr
    assert not out.exists() and Path(tmp_path).exists()
