"""A gpt-oss chat reply through the server's reply objects: its analysis channel is `reasoning_content`, its final
channel `content`, a commentary message to `functions.NAME` a tool call, streamed as OpenAI streams calls; the
channel markers, special tokens that decoding drops, never reach the client (issue 29: gpt-oss channels)."""

import json
from dataclasses import replace

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


def tokenizer_dir(path, template, markers=harmony.MARKERS, words=()):
    """The tests' tiny tokenizer with harmony's markers as special tokens (and `words` as whole tokens)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=_tokenizer_object(), bos_token="<s>", eos_token="<|return|>",
                                   additional_special_tokens=list(markers))
    fast.add_tokens(list(words))
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


def streamed(tokenizer, text, tools=("get_weather",)):
    reply = Reply("gpt-oss", chat=True, channels=replace(_channels(tokenizer), tools=frozenset(tools)))
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


def test_a_call_of_a_function_not_offered_is_text(tokenizer):
    # review: under tool_choice "none" (or to a function not offered) the call was still a tool call
    choices, whole = streamed(tokenizer, TOOL_REPLY, tools=())
    assert not any(c["delta"].get("tool_calls") for c in choices) and choices[-1]["finish_reason"] == "stop"
    assert "".join(c["delta"].get("content") or "" for c in choices) == '{"city": "Oslo", "days": 2}'
    assert whole["message"]["content"] == '{"city": "Oslo", "days": 2}' and "tool_calls" not in whole["message"]


def test_a_stop_string_ends_the_whole_answer_where_the_stream_ends(tokenizer):
    # review: the whole answer re-decoded every token id, past the stop string the scheduler had cut at
    reply = Reply("gpt-oss", chat=True, channels=_channels(tokenizer))
    _, result = generated(tokenizer, ANSWER)
    result.text = result.text[:result.text.index("there")]  # as the scheduler leaves it for stop=["there"]
    message = reply.whole(result)["choices"][0]["message"]
    assert message["content"] == "Hello " and message["reasoning_content"] == "A greeting."


def test_a_served_gpt_oss_style_reply_streams_its_answer_without_its_header(tmp_path):
    """A tiny Llama rigged to write `<|channel|>final<|message|>Hello<|return|>` after `assistant` (each token's
    likeliest next one fixed, a bigram chain), served: the stream's content is the answer alone.
    Review: the scheduler sent no event for a token whose text is empty, so the markers never reached the reader and
    the header words leaked into the content ("finalHello")."""
    from factory import cpu_plan, make_model
    from processes import served
    from safetensors.torch import load_file, save_file

    from stowage.engine.runtime.engine import Engine

    words = ("assistant", "final", "Hello")
    tok = tokenizer_dir(tmp_path / "tok", HARMONY_TEMPLATE, words=words)
    ids = {t: tok.token_id(t) for t in (*harmony.MARKERS, *words)}
    model_dir = make_model(tmp_path / "m", "llama", num_hidden_layers=1, eos_token_id=ids["<|return|>"])
    tokenizer_dir(model_dir, HARMONY_TEMPLATE, words=words)
    assert Tokenizer(model_dir).encode("assistant", add_special_tokens=False) == [ids["assistant"]]
    chain = ["assistant", "<|channel|>", "final", "<|message|>", "Hello", "<|return|>"]
    weights = load_file(model_dir / "model.safetensors")
    dims = range(1, len(chain))
    weights["model.embed_tokens.weight"][:, 1:len(chain)] = 0.0
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[1:len(chain)] = 0.0  # no layer writes into the chain's dimensions
    weights["model.norm.weight"].zero_()
    weights["lm_head.weight"].zero_()
    for dim, token, following in zip(dims, chain, chain[1:]):
        weights["model.embed_tokens.weight"][ids[token], dim] = 8.0
        weights["model.norm.weight"][dim] = 1.0
        weights["lm_head.weight"][ids[following], dim] = 10.0
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with served(Engine.load(model_dir, cpu_plan(model_dir, 256)), max_running=1, max_waiting=1) as client:
        ask = dict(model="m", messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=20)
        whole = client.chat.completions.create(**ask).choices[0]
        assert whole.message.content == "Hello" and whole.finish_reason == "stop"
        chunks = list(client.chat.completions.create(**ask, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert content == "Hello"
