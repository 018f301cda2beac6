import pytest

from app.context_policy import DROP_OLDEST, STOP, TRUNCATE_MIDDLE, ContextFullError, fit

SYSTEM = [{"role": "system", "content": "be brief"}]


def words(messages):
    """A stand-in tokenizer for the policy alone: one token per word plus two per message."""
    return sum(len(m["content"].split()) + 2 for m in messages)


def conversation(num_turns):
    out = []
    for i in range(num_turns):
        out.append({"role": "user", "content": f"question {i} " + "word " * 8})
        out.append({"role": "assistant", "content": f"answer {i} " + "word " * 8})
    out.append({"role": "user", "content": "last question"})
    return out


def test_everything_fits():
    messages = conversation(2)
    fitted = fit(SYSTEM, messages, words, 1000, STOP)
    assert fitted.kept == list(range(len(messages)))
    assert fitted.first_kept == 0
    assert fitted.messages[0] == SYSTEM[0]


def test_stop_says_how_much():
    with pytest.raises(ContextFullError, match="needs 80 tokens but the context holds 40"):
        fit(SYSTEM, conversation(3), words, 40, STOP)


def test_drop_oldest_keeps_system_and_whole_turns():
    messages = conversation(3)  # 7 messages: 3 turns of 2 (12 tokens each) and the last question
    fitted = fit(SYSTEM, messages, words, 40, DROP_OLDEST)
    assert fitted.messages[0] == SYSTEM[0]
    assert fitted.kept == [4, 5, 6]  # the two oldest turns went, never half a turn
    assert fitted.first_kept == 4
    assert fitted.prompt_tokens == words(fitted.messages) <= 40


def test_truncate_middle_keeps_the_first_turn():
    messages = conversation(3)
    fitted = fit(SYSTEM, messages, words, 40, TRUNCATE_MIDDLE)
    assert fitted.kept == [0, 1, 6]
    assert fitted.first_kept == 6  # the gap starts after the first turn


def test_last_message_alone_too_long():
    with pytest.raises(ContextFullError, match="last message alone"):
        fit(SYSTEM, conversation(1), words, 5, DROP_OLDEST)
