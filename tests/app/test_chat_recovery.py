"""A chat goes on after what used to end it: a stopped reply, a context that overflowed, a message to delete."""

from PySide6.QtCore import Qt


def _used_tokens(counter_text: str) -> int:
    return int(counter_text.split("·")[-1].split("/")[0].replace(",", "").strip())


def test_stop_keeps_the_tokens_in_context_on_the_counter(app_driver, tiny_model_dir, qtbot):
    window = app_driver.open(tiny_model_dir)
    app_driver.load(window)
    window.settings_panel.max_tokens.setValue(900)
    chat = window.chat

    def send_then_stop():
        app_driver.send(window, "Tell me a long story about the sea")
        qtbot.waitUntil(lambda: len(chat.view.reply_text) > 3, timeout=app_driver.timeout_ms)
        qtbot.mouseClick(chat.stop_button, Qt.MouseButton.LeftButton)

    reply = app_driver.reply(window, send_then_stop)
    assert reply.result.finish_reason == "cancelled"
    used = _used_tokens(chat.counter.text())
    assert used > 10  # the prompt (its template and the question) and the tokens streamed before Stop
    cid = chat.conversation_id
    stored = window.store.messages(cid)[-1]
    assert stored.meta["prompt_tokens"] + stored.meta["completion_tokens"] == used
    window.conversations.new_conversation()
    window.conversations.select(cid)  # shown again: the same count, read from the stored reply
    assert _used_tokens(chat.counter.text()) == used
