"""Completion mode (a base model) fits its text to the context as chat mode does, by the chat's policy."""

import json
import shutil

import pytest

MEDIUM = " ".join(f"memory{i} context{i} tokens{i}" for i in range(13))


@pytest.fixture
def base_model_dir(tmp_path, tiny_model_dir):
    """The tiny model without a chat template: a base model, which the app offers completion mode for."""
    base = tmp_path / "base-model"
    shutil.copytree(tiny_model_dir, base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    for template in base.glob("chat_template.*"):
        template.unlink()
    return base


def test_a_text_that_outgrows_the_context_offers_the_chats_choices_and_drops_its_oldest_turns(
        app_driver, base_model_dir, qtbot):
    # Caught: completion mode sent the whole text every time; once it outgrew the context every message failed with
    # the engine's "shorten them, or serve with a larger --context", and no way on was offered (review finding 9).
    from stowage.app.chat_panel import DROP_OLDEST, NEW_CHAT

    window = app_driver.open(base_model_dir)
    app_driver.load(window, context_tokens=512)  # the settings' policy: stop and say so
    window.settings_panel.max_tokens.setValue(4)
    chat = window.chat
    chat.completion_button.setChecked(True)
    one = len(window.client.worker.tokenizer.encode(MEDIUM))
    assert 2 * (one + 8) < 512 - 4 < 3 * one  # two texts and their continuations fit, three texts do not
    for _ in range(2):
        app_driver.reply(window, lambda: app_driver.send(window, MEDIUM))
    cid = chat.conversation_id

    app_driver.send(window, MEDIUM)
    qtbot.waitUntil(chat.error.isVisible, timeout=app_driver.timeout_ms)
    assert "needs" in chat.error.text() and "context holds 508" in chat.error.text()
    assert chat.notice.isVisible() and chat.notice.button(NEW_CHAT) is not None

    reply = app_driver.reply(window, chat.notice.button(DROP_OLDEST).click)
    assert reply.result.finish_reason != "error" and not chat.error.isVisible()
    # The oldest text (and its continuation) went: the prompt is the rest, as the tokenizer encodes it.
    messages = window.store.messages(cid)
    answered = messages[: max(i for i, m in enumerate(messages) if m.role == "user") + 1]
    start = [m.id for m in answered].index(window.store.conversation(cid).memory_start_id)
    assert start > 0 and chat.view.memory_marker is not None
    assert reply.result.prompt_tokens == len(window.client.worker.tokenizer.encode(
        "".join(m.content for m in answered[start:]))) <= 512 - 4
