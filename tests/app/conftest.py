"""Shared fixtures for the app tests: offscreen Qt, a temp data folder and QSettings, a tiny real model."""

from __future__ import annotations

import json
import os

# Before anything imports Qt: no display is needed, and none is touched.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CORPUS = [
    "Hello! How are you today? I am fine, thank you.",
    "The quick brown fox jumps over the lazy dog.",
    "Stowage runs large language models on your own computer.",
    "```python\nprint('hello world')\n```",
    "Memory, context, tokens, layers, blocks and caches.",
] * 20


def _write_tokenizer(model_dir):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "<|end|>",
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    return tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random Llama with a byte-level BPE tokenizer and a chat template, saved as safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = _write_tokenizer(model_dir)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.token_to_id("<s>"),
        eos_token_id=tokenizer.token_to_id("<|end|>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir


@pytest.fixture
def broken_model_dir(tmp_path, tiny_model_dir):
    """The tiny model with its weight file cut short, as an interrupted download leaves it."""
    import shutil

    model_dir = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, model_dir)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return model_dir


@pytest.fixture(autouse=True)
def isolated_user_files(tmp_path, monkeypatch):
    """Every test gets its own data folder and QSettings file; the user's are never touched."""
    data = tmp_path / "stowage-data"
    monkeypatch.setenv("STOWAGE_DATA_DIR", str(data))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    from PySide6.QtCore import QSettings

    QSettings.setDefaultFormat(QSettings.Format.IniFormat)
    QSettings.setPath(QSettings.Format.IniFormat, QSettings.Scope.UserScope, str(tmp_path / "qsettings"))
    return data
