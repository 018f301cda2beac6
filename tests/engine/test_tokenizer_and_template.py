"""Tokenization and chat templates equal transformers' on the same files; streaming text is exact."""

import json

import pytest
from factory import make_model, save_tokenizer
from transformers import AutoTokenizer

from stowage.engine.text.chat_template import TemplateError, render
from stowage.engine.errors import StowageWarning
from stowage.engine.text.tokenizer import Tokenizer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi! Café 東京 🚀"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "How big is the KV cache?"},
]
# A template in the style of real models: loops, conditionals, tojson, raise_exception.
QWEN_LIKE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ {'n': messages|length}|tojson }}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tok"), "llama")


@pytest.mark.parametrize("template", [None, QWEN_LIKE])
def test_chat_template_matches_transformers(tmp_path, template):
    if template:
        save_tokenizer(tmp_path, chat_template=template)
    else:
        save_tokenizer(tmp_path)
    ours, theirs = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for add in (True, False):
        assert ours.render_chat(MESSAGES, add) == theirs.apply_chat_template(MESSAGES, tokenize=False,
                                                                             add_generation_prompt=add)
        expected = theirs.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=add)
        expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
        assert ours.apply_chat_template(MESSAGES, add) == list(expected)


def test_template_raise_exception_is_a_typed_error(tmp_path):
    save_tokenizer(tmp_path, chat_template=QWEN_LIKE)
    with pytest.raises(TemplateError, match="bad role"):
        Tokenizer(tmp_path).render_chat([{"role": "wizard", "content": "x"}])


def test_template_runs_in_a_sandbox():
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TemplateError):
        render(evil, [])


def test_missing_template_falls_back_with_a_warning(tmp_path):
    save_tokenizer(tmp_path, chat_template=None)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    tok = Tokenizer(tmp_path)
    with pytest.warns(StowageWarning, match="no chat template"):
        text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text == "User: hi\n\nAssistant:"


def test_stream_decoder_reassembles_multibyte_characters(model_dir):
    tok = Tokenizer(model_dir)
    text = "Überraschung! Café 東京 🚀 naïve; Ωμέγα ✨ 😀 ñandú"  # the last words are not in the BPE corpus
    ids = tok.encode(text, add_special_tokens=False)
    decoder = tok.stream_decoder()
    pieces = [decoder.push(i) for i in ids]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # byte-level BPE splits the emoji over several tokens, so some pushes must have held text back
    assert pieces.count("") > 0
