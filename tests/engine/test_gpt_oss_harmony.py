"""gpt-oss's harmony reply format (engine/text/harmony.py): channels, tool calls, and a reply read as it streams."""

import pytest

from stowage.engine.text.harmony import HarmonyStream, parse

REPLY = ("<|channel|>analysis<|message|>The user greets me. I should greet back.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>")
TOOL = ("<|channel|>analysis<|message|>Need the weather: call the tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Oslo"}<|call|>')


def test_reasoning_and_answer_are_told_apart():
    reply = parse(REPLY)
    assert [m.channel for m in reply.messages] == ["analysis", "final"]
    assert reply.reasoning == "The user greets me. I should greet back."
    assert reply.content == "Hello! How can I help?"
    assert reply.stop == "<|return|>" and all(m.done for m in reply.messages) and reply.tool_calls == []


def test_a_tool_call_names_its_function_and_arguments():
    reply = parse(TOOL)
    assert reply.tool_calls == [("get_weather", '{"city": "Oslo"}')]
    call = reply.messages[-1]
    assert (call.channel, call.recipient, call.content_type) == ("commentary", "functions.get_weather", "json")
    assert reply.stop == "<|call|>" and reply.content == ""


def test_the_recipient_may_follow_the_role():
    reply = parse("<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{}<|call|>")
    assert reply.tool_calls == [("lookup", "{}")] and reply.messages[0].content_type == "json"


def test_a_reply_cut_short_keeps_what_was_written():
    reply = parse("<|channel|>analysis<|message|>Thinking about it<|end|><|start|>assistant<|channel|>final<|mess")
    assert reply.reasoning == "Thinking about it" and reply.stop is None
    assert not reply.messages[-1].done and reply.content == ""


def test_text_without_the_format_is_the_content():
    reply = parse("Just an answer, no channels.")
    assert reply.content == "Just an answer, no channels." and reply.reasoning == ""


@pytest.mark.parametrize("text", [REPLY, TOOL])
def test_streamed_one_character_at_a_time_it_parses_the_same(text):
    stream = HarmonyStream()
    deltas = [d for c in text for d in stream.feed(c)] + stream.close()
    whole = parse(text)
    assert [(m.channel, m.content, m.recipient, m.done) for m in stream.reply.messages] == \
        [(m.channel, m.content, m.recipient, m.done) for m in whole.messages]
    for i, message in enumerate(whole.messages):  # each message's deltas are its text, on its channel, no marker
        assert "".join(d.text for d in deltas if d.index == i) == message.content
        assert {d.channel for d in deltas if d.index == i} <= {message.channel}
    assert not any("<|" in d.text for d in deltas)


def test_a_marker_split_between_deltas_is_held_back_not_shown():
    stream = HarmonyStream()
    assert [(d.channel, d.text) for d in stream.feed("<|channel|>final<|message|>Hi <|")] == [("final", "Hi ")]
    assert stream.feed("ret") == []  # still the start of <|return|>
    assert stream.feed("urn|>") == []
    assert stream.reply.content == "Hi " and stream.reply.stop == "<|return|>"
    # what only looked like the start of a marker is text after all
    stream = HarmonyStream()
    assert [d.text for d in stream.feed("<|channel|>final<|message|>a <")] == ["a "]
    assert [d.text for d in stream.feed("b")] == ["<b"]
