import pytest

from stowage.app.context_policy import DROP_OLDEST, STOP, TRUNCATE_MIDDLE, ContextFullError, fit

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


def test_truncate_middle_lets_the_first_turn_go_when_it_alone_does_not_fit():
    messages = [{"role": "user", "content": "setup " * 40}, {"role": "assistant", "content": "ok " * 40},
                {"role": "user", "content": "question " * 5}, {"role": "assistant", "content": "answer " * 5},
                {"role": "user", "content": "Continue."}]
    fitted = fit(SYSTEM, messages, words, 20, TRUNCATE_MIDDLE)  # the first turn is 84 tokens; the last 3
    assert fitted.kept == [4]
    assert fitted.kept_head == 0 and fitted.first_kept == 4


def test_the_kept_head_is_counted():
    fitted = fit(SYSTEM, conversation(3), words, 40, TRUNCATE_MIDDLE)
    assert fitted.kept_head == 2  # the first turn (question and answer) sits before the gap
    assert fit(SYSTEM, conversation(3), words, 40, DROP_OLDEST).kept_head == 0
    assert fit(SYSTEM, conversation(3), words, 1000, TRUNCATE_MIDDLE).kept_head == 0  # no gap


def test_too_long_says_what_the_last_message_itself_needs():
    messages = [{"role": "user", "content": "setup " * 40}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "word " * 10}]
    with pytest.raises(ContextFullError, match="last message alone needs 16 tokens"):  # 4 system + 12 its own
        fit(SYSTEM, messages, words, 10, TRUNCATE_MIDDLE)
