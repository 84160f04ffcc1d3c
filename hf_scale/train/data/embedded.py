"""The embedded default: a tiny Llama-style model and a sample SFT dataset shipped inside the package.

With no model or data arguments, train.py fine-tunes EMBEDDED_MODEL_DIR on EMBEDDED_DATA_FILE (their paths:
hf_scale.contract.embedded_assets) on CPU in seconds, fully offline. Both are *generated* by this module,
deterministically, so the shipped files can be checked for drift (tests/train/data/test_embedded.py) and
regenerated with::

    python -m hf_scale.train.data.embedded
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_scale.contract.embedded_assets import ASSETS_DIR, EMBEDDED_DATA_FILE, EMBEDDED_MODEL_DIR

WEIGHTS_SEED = 0
DATA_SEED = 0
NUM_SAMPLE_ROWS = 256
MAX_POSITION_EMBEDDINGS = 512

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
# Role markers are single tokens so that a chat turn costs one token of overhead, not ten bytes.
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")

# `{% generation %}` marks the assistant's tokens: `apply_chat_template(...,
# return_assistant_tokens_mask=True)` turns it into the mask used for completion-only loss. The
# eos ends every assistant turn inside the marked span, so the model learns to stop.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\n' }}{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with no merges: every byte is one token, so any text round-trips.

    Nothing is learned from data, so the vocabulary is a pure function of this code.
    """
    specials = [UNK, BOS, EOS, PAD, *ROLE_TOKENS]
    # Sorting makes the id of each byte independent of the order `alphabet()` happens to return.
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: index for index, token in enumerate([*specials, *byte_chars])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tokenizer.add_special_tokens(specials)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Like Llama's tokenizers: plain `tokenizer(text)` starts with bos.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=MAX_POSITION_EMBEDDINGS,
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_llama(out_dir: Path) -> None:
    """Write a tiny, randomly initialised (fixed seed) Llama model, its tokenizer and generation config."""
    tokenizer = build_tokenizer()
    # A multiple of 8 keeps the embedding matrix friendly to tensor cores, as real vocabularies are.
    vocab_size = -(-len(tokenizer) // 8) * 8
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(WEIGHTS_SEED)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    if rng.random() < 0.5:
        return f"What is {a} plus {b}?", str(a + b)
    return f"What is {a} times {b}?", str(a * b)


_WORDS = (
    "apple", "banana", "cherry", "dragon", "engine", "forest", "garden", "harbor", "island",
    "jacket", "kettle", "lemon", "mountain", "needle", "orange", "pencil", "quartz", "river",
    "silver", "tunnel", "umbrella", "violet", "window", "yellow", "zebra",
)


def _word_fact(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(_WORDS)
    kind = rng.randrange(3)
    if kind == 0:
        return f"How many letters are in the word '{word}'?", str(len(word))
    if kind == 1:
        return f"What is the first letter of '{word}'?", word[0]
    return f"Write '{word}' in capital letters.", word.upper()


def _reverse(rng: random.Random) -> tuple[str, str]:
    text = " ".join(rng.sample(_WORDS, rng.randint(1, 4)))
    return f"Reverse the string '{text}'.", text[::-1]


def _count(rng: random.Random) -> tuple[str, str]:
    # The long tail: responses of up to ~300 bytes (= tokens), so packing has something to pack.
    start = rng.randint(0, 50)
    stop = start + rng.randint(10, 75)
    return (
        f"List the numbers from {start} to {stop}, separated by commas.",
        ", ".join(str(n) for n in range(start, stop + 1)),
    )


def sample_rows(num_rows: int = NUM_SAMPLE_ROWS, seed: int = DATA_SEED) -> list[dict[str, str]]:
    """Instruction/response rows: mostly short answers, one in ten a long list."""
    rng = random.Random(seed)
    tasks = (_arithmetic, _word_fact, _reverse, _count)
    rows = []
    for _ in range(num_rows):
        task = rng.choices(tasks, weights=(4, 3, 2, 1))[0]
        instruction, response = task(rng)
        rows.append({"instruction": instruction, "response": response})
    return rows


def write_sample_data(path: Path) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in sample_rows()), encoding="utf-8")


def main() -> None:
    """Regenerate the shipped assets; each is built in a temp location and then moved into place."""
    ASSETS_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=ASSETS_DIR) as tmp:
        tmp_model = Path(tmp) / "model"
        tmp_data = Path(tmp) / "data.jsonl"
        build_tiny_llama(tmp_model)
        write_sample_data(tmp_data)
        # save_pretrained writes the weights through a private temp file (mode 0600); the packaged
        # assets must be readable by every user of an installation.
        for path in [*tmp_model.iterdir(), tmp_data]:
            path.chmod(0o644)
        if EMBEDDED_MODEL_DIR.exists():
            shutil.rmtree(EMBEDDED_MODEL_DIR)
        tmp_model.rename(EMBEDDED_MODEL_DIR)
        tmp_data.replace(EMBEDDED_DATA_FILE)
    print(f"wrote {EMBEDDED_MODEL_DIR} and {EMBEDDED_DATA_FILE}")


if __name__ == "__main__":
    main()
