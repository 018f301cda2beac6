"""A gpt-oss chat reply through the server's reply objects: its analysis channel is `reasoning_content`, its final
channel `content`, a commentary message to `functions.NAME` a tool call, streamed as OpenAI streams calls; the
channel markers, special tokens that decoding drops, never reach the client (issue 29: gpt-oss channels)."""

import json

import pytest
from factory import _tokenizer_object

from stowage.engine.runtime.generation import GenerationResult, TokenEvent
from stowage.engine.server.app import _channels
from stowage.engine.server.responses import Reply
from stowage.engine.text import harmony
from stowage.engine.text.tokenizer import Tokenizer

HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final"
                    "{% endif %}<|message|>{{ m.content }}<|end|>{% endfor %}<|start|>assistant")  # gpt-oss's, cut
TOOL_REPLY = ("<|channel|>analysis<|message|>Need the weather in Oslo.<|end|><|start|>assistant<|channel|>commentary "
              'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo", "days": 2}<|call|>')
ANSWER = ("<|channel|>analysis<|message|>A greeting.<|end|><|start|>assistant<|channel|>final<|message|>"
          "Hello there!<|return|>")


def tokenizer_dir(path, template, markers=harmony.MARKERS):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=_tokenizer_object(), bos_token="<s>", eos_token="<|return|>",
                                   additional_special_tokens=list(markers))
    fast.chat_template = template
    fast.save_pretrained(path)
    return Tokenizer(path)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tokenizer_dir(tmp_path_factory.mktemp("harmony"), HARMONY_TEMPLATE)


def generated(tokenizer, text):
    """The events and result the engine would give for `text`: each token's text with special tokens dropped."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    events = [TokenEvent(i, tokenizer.decode([i])) for i in ids]
    assert any(not e.text for e in events)  # the markers are special tokens: decoding drops them
    return events, GenerationResult(text=tokenizer.decode(ids), token_ids=ids, completion_tokens=len(ids),
                                    finish_reason="stop")


def streamed(tokenizer, text):
    reply = Reply("gpt-oss", chat=True, channels=_channels(tokenizer))
    events, result = generated(tokenizer, text)
    chunks = [c for e in events for c in reply.token_chunks(e)] + reply.end_chunks(result)
    return [c["choices"][0] for c in chunks], reply.whole(result)["choices"][0]


def test_reasoning_and_answer_stream_apart_without_markers(tokenizer):
    choices, whole = streamed(tokenizer, ANSWER)
    deltas = [c["delta"] for c in choices]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "A greeting."
    assert "".join(d.get("content") or "" for d in deltas) == "Hello there!"
    assert not any("<|" in json.dumps(d) for d in deltas)
    assert choices[-1]["finish_reason"] == "stop"
    assert whole["message"]["content"] == "Hello there!" and whole["message"]["reasoning_content"] == "A greeting."


def test_a_commentary_message_to_a_function_is_a_tool_call_streamed_and_whole(tokenizer):
    choices, whole = streamed(tokenizer, TOOL_REPLY)
    calls = [call for c in choices for call in c["delta"].get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert all(c["index"] == 0 for c in calls) and all("id" not in c for c in calls[1:])
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(arguments) == {"city": "Oslo", "days": 2}
    assert "".join(c["delta"].get("content") or "" for c in choices) == ""  # the call is not content
    assert choices[-1]["finish_reason"] == "tool_calls"
    message = whole["message"]
    assert whole["finish_reason"] == "tool_calls" and message["reasoning_content"] == "Need the weather in Oslo."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("get_weather", {"city": "Oslo", "days": 2})]


def test_other_models_have_no_channels(tmp_path, tokenizer):
    plain = tokenizer_dir(tmp_path / "plain", "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert _channels(plain) is None  # a template without harmony's markers
    no_tokens = tokenizer_dir(tmp_path / "no-tokens", HARMONY_TEMPLATE, markers=())
    assert _channels(no_tokens) is None  # the markers are text, not tokens of the vocabulary
    assert _channels(tokenizer) is not None
