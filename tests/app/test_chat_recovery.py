"""A chat goes on after what used to end it: a stopped reply, a context that overflowed, a message to delete."""

from PySide6.QtCore import Qt


def _used_tokens(counter_text: str) -> int:
    return int(counter_text.split("·")[-1].split("/")[0].replace(",", "").strip())


def test_stop_keeps_the_tokens_in_context_on_the_counter(app_driver, tiny_model_dir, qtbot):
    window = app_driver.open(tiny_model_dir)
    app_driver.load(window)
    window.settings_panel.max_tokens.setValue(900)
    chat = window.chat
    assert not chat.notice.isVisible() and not chat.completion_button.isVisible()  # a chat model: no base notice

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


MEDIUM = " ".join(f"memory{i} context{i} tokens{i}" for i in range(12))


def test_a_full_chat_offers_to_drop_old_turns_or_start_anew_and_a_message_can_be_deleted(app_driver, tiny_model_dir,
                                                                                         qtbot):
    from stowage.app.chat_panel import DROP_OLDEST, NEW_CHAT

    window = app_driver.open(tiny_model_dir)
    app_driver.load(window, context_tokens=512)  # the settings' policy: stop and say so
    window.settings_panel.max_tokens.setValue(4)
    chat = window.chat
    chat.system_prompt._finish("Answer in French.")  # this chat's own system prompt, as Edit then Save sets it
    one = window.client.worker._count_tokens([{"role": "user", "content": MEDIUM}])
    assert 2 * one + 60 < 512 - 4 < 3 * one  # two turns fit (4 tokens kept for the reply), three do not
    for _ in range(2):
        app_driver.reply(window, lambda: app_driver.send(window, MEDIUM))
    cid = chat.conversation_id
    app_driver.send(window, MEDIUM)  # the third does not fit
    qtbot.waitUntil(lambda: chat.notice.isVisible(), timeout=app_driver.timeout_ms)
    assert chat.error.isVisible() and "context" in chat.error.text()

    # A new chat carrying the system prompt, the message waiting in the input box.
    chat.notice.button(NEW_CHAT).click()
    new = chat.conversation_id
    assert new != cid and window.store.conversation(new).system_prompt == "Answer in French."
    assert window.conversations.current_id == new and chat.input.toPlainText() == MEDIUM
    assert chat.system_prompt.prompt == "Answer in French." and window.store.messages(new) == []

    # Or, back in the full chat, forgetting its oldest turns: Regenerate asks again, and the choice is offered again.
    window.conversations.select(cid)
    assert not chat.notice.isVisible()
    qtbot.mouseClick(chat.regenerate_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: chat.notice.isVisible(), timeout=app_driver.timeout_ms)
    reply = app_driver.reply(window, chat.notice.button(DROP_OLDEST).click)
    assert reply.result.prompt_tokens <= 512 and window.store.conversation(cid).overflow_policy == "drop_oldest"
    assert chat.view.memory_marker is not None and not chat.notice.isVisible()
    app_driver.reply(window, lambda: app_driver.send(window, MEDIUM))  # and later messages go on, in this chat
    assert window.store.messages(cid)[-1].role == "assistant" and not chat.error.isVisible()

    # A message deleted from the chat is gone from the file; the ones after it stay.
    before = window.store.messages(cid)
    qtbot.mouseClick(chat.view.widgets[1].delete_button, Qt.MouseButton.LeftButton)
    after = window.store.messages(cid)
    assert [m.id for m in after] == [before[0].id] + [m.id for m in before[2:]]
    assert [w.message.id for w in chat.view.widgets] == [m.id for m in after]


def test_regenerating_at_temperature_0_says_it_repeats_and_offers_a_temperature(app_driver, tiny_model_dir, qtbot):
    from stowage.app.chat_panel import RETRY, RETRY_TEMPERATURE

    window = app_driver.open(tiny_model_dir)
    app_driver.load(window)  # greedy sampling
    window.settings_panel.max_tokens.setValue(8)
    chat = window.chat
    first = app_driver.reply(window, lambda: app_driver.send(window, "Say something"))
    assert not chat.notice.isVisible() and "word for word" in chat.regenerate_button.toolTip()
    again = app_driver.reply(window, lambda: qtbot.mouseClick(chat.regenerate_button, Qt.MouseButton.LeftButton))
    assert again.result.text == first.result.text  # word for word
    assert chat.notice.isVisible() and "same word for word" in chat.notice.label.text()
    app_driver.reply(window, chat.notice.button(RETRY).click)
    last = window.store.messages(chat.conversation_id)[-1]
    assert last.meta["sampling"]["temperature"] == RETRY_TEMPERATURE and len(last.siblings) == 3
    assert window.settings_panel.temperature.value() == 0.0  # the settings stay as they were
    assert not chat.notice.isVisible()


def test_a_base_model_is_named_so_and_completion_mode_continues_the_text(app_driver, tiny_model_dir, tmp_path):
    import json
    import shutil

    from stowage.app.chat_panel import USE_COMPLETION

    base = tmp_path / "base-model"
    shutil.copytree(tiny_model_dir, base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    for template in base.glob("chat_template.*"):
        template.unlink()
    window = app_driver.open(base)
    app_driver.load(window)
    window.settings_panel.max_tokens.setValue(6)
    chat = window.chat
    assert chat.notice.isVisible() and "base model" in chat.notice.label.text()
    assert chat.completion_button.isVisible() and not chat.completion_button.isChecked()
    chat.notice.button(USE_COMPLETION).click()
    assert chat.completion_button.isChecked() and "continues" in chat.view.placeholder.text()
    text = "Once upon a time"
    reply = app_driver.reply(window, lambda: app_driver.send(window, text))
    # The text alone, as the tokenizer encodes it: no template's roles around it.
    assert reply.result.prompt_tokens == len(window.client.worker.tokenizer.encode(text))
    assert window.store.messages(chat.conversation_id)[-1].content == reply.result.text
