"""A chat whose roles no longer alternate (a message deleted) still goes on under templates that demand they do."""

import json
import shutil

import pytest
from PySide6.QtCore import Qt


@pytest.fixture
def gemma_template_model(tmp_path, tiny_model_dir):
    """The tiny model with the built-in Gemma template as its own: it raises unless the roles alternate, starting with
    the user, as Gemma's and Mistral's published templates do."""
    from stowage.engine.text.chat_template import GEMMA_TEMPLATE

    model_dir = tmp_path / "gemma-template"
    shutil.copytree(tiny_model_dir, model_dir)
    for template in model_dir.glob("chat_template.*"):
        template.unlink()
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = GEMMA_TEMPLATE
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return model_dir


def _send(app_driver, qtbot, window, text):
    """Send text and wait for its reply, or for an error instead."""
    chat = window.chat
    count = len(window.store.messages(chat.conversation_id)) if chat.conversation_id is not None else 0
    app_driver.send(window, text)
    qtbot.waitUntil(lambda: chat.error.isVisible() or (
        not chat.is_replying and len(window.store.messages(chat.conversation_id)) == count + 2),
        timeout=app_driver.timeout_ms)
    assert not chat.error.isVisible(), chat.error.text()
    return window.store.messages(chat.conversation_id)


def _delete(qtbot, chat, message_id):
    widget = next(w for w in chat.view.widgets if w.message.id == message_id)
    qtbot.mouseClick(widget.delete_button, Qt.MouseButton.LeftButton)


def test_deleting_a_reply_or_a_question_never_stops_the_chat(app_driver, gemma_template_model, qtbot):
    # Caught: after a deleted reply the app sent user, user, and every later message failed with the template's
    # "Conversation roles must alternate" (review finding 6).
    window = app_driver.open(gemma_template_model)
    app_driver.load(window)
    window.settings_panel.max_tokens.setValue(3)
    chat, worker = window.chat, window.client.worker
    _send(app_driver, qtbot, window, "First question")
    q1, a1, q2, a2 = _send(app_driver, qtbot, window, "Second question")
    _delete(qtbot, chat, a1.id)  # two questions in a row now
    assert [m.role for m in window.store.messages(chat.conversation_id)] == ["user", "user", "assistant"]
    messages = _send(app_driver, qtbot, window, "Third question")
    # The two questions went as one user turn, a blank line apart: what the stored prompt count says was read.
    system = [{"role": "system", "content": chat.system_prompt.prompt}] if chat.system_prompt.prompt else []
    sent = system + [{"role": "user", "content": "First question\n\nSecond question"},
            {"role": "assistant", "content": a2.content}, {"role": "user", "content": "Third question"}]
    assert messages[-1].meta["prompt_tokens"] == len(worker.tokenizer.apply_chat_template(sent))

    # Two replies in a row, then a chat that starts with a reply: the replies before the first question stay on
    # screen and out of the model's memory (its line says where memory starts).
    q3 = messages[3]
    for message in (q3, q1, q2):
        _delete(qtbot, chat, message.id)
    assert [m.role for m in window.store.messages(chat.conversation_id)] == ["assistant", "assistant"]
    messages = _send(app_driver, qtbot, window, "Fourth question")
    assert messages[-1].meta["prompt_tokens"] == len(worker.tokenizer.apply_chat_template(
        system + [{"role": "user", "content": "Fourth question"}]))
    assert chat.view.memory_marker is not None


def test_same_role_neighbours_are_merged_and_tool_turns_never():
    from stowage.app.context_policy import alternating

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "1", "tool_call_id": "c1"},
                {"role": "tool", "content": "2", "tool_call_id": "c1"},
                {"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert alternating(messages) == [
        {"role": "user", "content": "a\n\nb"}, messages[2], messages[3], messages[4],
        {"role": "assistant", "content": "x\n\ny"}]
