"""Regenerate, edit-and-resend, the context overflow policy, and settings kept per model."""

from PySide6.QtCore import Qt

from stowage.app.context_policy import DROP_OLDEST, POLICIES, TRUNCATE_MIDDLE
from stowage.app.model_settings import SAMPLING_PRESETS, load_model_settings, open_settings

LONG = " ".join(f"memory{i} context{i} tokens{i}" for i in range(30))


def test_regenerate_and_edit_keep_the_old_versions_and_the_arrows_switch(app_driver, tiny_model_dir):
    window = app_driver.open(tiny_model_dir)
    app_driver.load(window)
    window.settings_panel.max_tokens.setValue(6)
    # Greedy: a random reply of this tiny model can be empty (its first token the end, or only special tokens),
    # and an empty reply is, rightly, not stored; the versions are what is tested, not that the texts differ.
    window.settings_panel.temperature.setValue(0.0)
    chat = window.chat
    app_driver.reply(window, lambda: app_driver.send(window, "first question"))
    cid = chat.conversation_id
    question, old_reply = window.store.messages(cid)
    app_driver.reply(window, chat.regenerate)
    shown = window.store.messages(cid)
    assert [m.role for m in shown] == ["user", "assistant"] and shown[0].id == question.id
    new_reply = shown[1]
    assert new_reply.siblings == (old_reply.id, new_reply.id)  # the old reply is kept beside the new one
    reply_widget = chat.view.widgets[1]
    assert reply_widget.version.text() == "2/2" and not reply_widget.version.isHidden()
    reply_widget.previous_button.click()
    assert [m.id for m in window.store.messages(cid)] == [question.id, old_reply.id]
    assert chat.view.widgets[1].text == old_reply.content and chat.view.widgets[1].version.text() == "1/2"

    user_widget = chat.view.widgets[0]
    user_widget.start_edit()
    user_widget.editor.setPlainText("edited question")
    app_driver.reply(window, user_widget.save_button.click)
    edited = window.store.messages(cid)
    assert [m.role for m in edited] == ["user", "assistant"] and edited[0].content == "edited question"
    assert edited[0].siblings == (question.id, edited[0].id) and edited[1].id not in (old_reply.id, new_reply.id)
    assert chat.view.widgets[0].text == "edited question" and chat.view.widgets[0].version.text() == "2/2"
    chat.view.widgets[0].previous_button.click()  # the first question again, with the reply last shown under it
    assert [m.id for m in window.store.messages(cid)] == [question.id, old_reply.id]
    assert [w.message.id for w in chat.view.widgets] == [question.id, old_reply.id]


def test_drop_oldest_turns_marks_where_memory_starts(app_driver, tiny_model_dir):
    window = app_driver.open(tiny_model_dir)
    panel = window.settings_panel
    app_driver.wait_planned(window)
    panel.policy.setCurrentIndex(panel.policy.findData(DROP_OLDEST))
    app_driver.load(window, context_tokens=512)
    panel.max_tokens.setValue(4)
    count = window.client.worker._count_tokens
    assert count([{"role": "user", "content": LONG}]) > 150  # three of them cannot fit in 512 tokens
    for _ in range(3):
        last = app_driver.reply(window, lambda: app_driver.send(window, LONG))
        assert last.result.prompt_tokens <= 512
    cid = window.chat.conversation_id
    row = window.store.conversation(cid)
    messages = window.store.messages(cid)
    assert row.memory_start_id is not None and row.memory_start_id != messages[0].id
    assert window.chat.view.memory_marker is not None
    # The line sits right above the first message the model still sees.
    column = window.chat.view._column
    marker_at = column.indexOf(window.chat.view.memory_marker)
    kept = next(w for w in window.chat.view.widgets if w.message.id == row.memory_start_id)
    assert column.indexOf(kept) == marker_at + 1


def test_settings_are_kept_per_model(app_driver, tiny_model_dir):
    window = app_driver.open(tiny_model_dir)
    panel = window.settings_panel
    app_driver.wait_planned(window)
    panel.temperature.setValue(1.25)
    panel.context.spin.setValue(1536)
    panel.system_prompt.setPlainText("Answer in French.")
    window.close()
    saved = load_model_settings(open_settings(), tiny_model_dir)
    assert saved.sampling.temperature == 1.25
    assert (saved.context_tokens, saved.system_prompt) == (1536, "Answer in French.")
    again = app_driver.open(tiny_model_dir)
    app_driver.wait_planned(again)
    assert again.settings_panel.temperature.value() == 1.25
    assert again.settings_panel.context.context_tokens == 1536
    assert again.settings_panel.plan.context_tokens == 1536


def test_window_layout_is_remembered(app_driver, tiny_model_dir):
    window = app_driver.open(tiny_model_dir)
    window.left.setSizes([150, 700])  # the conversation list narrower than the default 200
    window.vertical.setSizes([520, 250])  # taller graphs
    list_width, graph_height = window.left.sizes()[0], window.vertical.sizes()[1]
    window.close()
    assert not open_settings().value("window/geometry").isEmpty()
    again = app_driver.open(tiny_model_dir)
    # (The offscreen screen is smaller than the window, so Qt may clamp the restored geometry; the
    # panes whose size the user chose keep it, extra room goes to the chat and the settings.)
    assert again.left.sizes()[0] == list_width
    assert again.vertical.sizes()[1] == graph_height


def test_deleting_a_chat_while_it_replies_stops_the_reply(app_driver, tiny_model_dir, qtbot):
    window = app_driver.open(tiny_model_dir)
    app_driver.load(window)
    window.settings_panel.max_tokens.setValue(900)
    chat = window.chat

    def send_then_delete():
        app_driver.send(window, "Tell me a long story")
        qtbot.waitUntil(lambda: len(chat.view.reply_text) > 3, timeout=app_driver.timeout_ms)
        window.conversations.delete(chat.conversation_id)

    reply = app_driver.reply(window, send_then_delete)
    assert reply.result.finish_reason == "cancelled" and reply.result.completion_tokens < 900
    # Its cached tokens are freed too: the engine releases a cancelled reply's K/V as it ends it (the app keeps no
    # handle per chat; tests/engine/test_server_batching.py checks the engine's side)
    assert chat.send_button.isEnabled() and not chat.stop_button.isEnabled()
    assert window.store.conversations() == []  # nothing was stored for the deleted chat
    assert chat.view.widgets == []


def test_messages_follow_the_state_they_describe(app_driver, tiny_model_dir, qtbot):
    window = app_driver.open(tiny_model_dir)
    chat = window.chat
    app_driver.wait_planned(window)
    app_driver.send(window, "hello?")
    assert chat.error.isVisible() and "No model is loaded" in chat.error.text()
    assert "press Load" in chat.view.placeholder.text()
    app_driver.load(window)
    assert not chat.error.isVisible()  # it was about the missing model, which is there now
    assert chat.view.placeholder.isVisible() and "press Load" not in chat.view.placeholder.text()
    assert not chat.regenerate_button.isEnabled()  # nothing to write again in an empty chat
    window.conversations.new_conversation()
    assert not chat.regenerate_button.isEnabled()
    window.settings_panel.max_tokens.setValue(4)
    app_driver.reply(window, lambda: app_driver.send(window, "hello?"))
    assert chat.regenerate_button.isEnabled()
    qtbot.mouseClick(window.settings_panel.unload_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.loaded_dir is None, timeout=app_driver.timeout_ms)
    window.conversations.new_conversation()
    assert "press Load" in chat.view.placeholder.text()


def _used_tokens(counter_text: str) -> tuple[int, int]:
    used, total = counter_text.split("·")[-1].replace("tokens", "").split("/")
    return int(used.replace(",", "")), int(total.replace(",", ""))


def test_a_reply_that_fills_the_context_says_what_can_help(app_driver, tiny_model_dir):
    window = app_driver.open(tiny_model_dir)
    panel, chat = window.settings_panel, window.chat
    app_driver.load(window, context_tokens=512)
    panel.max_tokens.setValue(2000)
    reply = app_driver.reply(window, lambda: app_driver.send(window, "Tell me everything"))
    assert reply.result.finish_reason == "context_full"
    used, total = _used_tokens(chat.counter.text())
    assert total == 512 and used <= 512
    text = chat.error.text()
    assert chat.error.isVisible() and "512-token context" in text and "larger context" in text
    assert POLICIES[DROP_OLDEST] in text  # under "stop", dropping the oldest turns lets the next message in

    panel.policy.setCurrentIndex(panel.policy.findData(DROP_OLDEST))
    reply = app_driver.reply(window, lambda: app_driver.send(window, "And then?"))
    assert reply.result.finish_reason == "context_full"
    assert "When full" not in chat.error.text() and POLICIES[DROP_OLDEST] not in chat.error.text()


def test_switching_back_to_a_chat_reuses_its_cache(app_driver, tiny_model_dir):
    window = app_driver.open(tiny_model_dir)
    app_driver.load(window, context_tokens=2048)
    window.settings_panel.max_tokens.setValue(4)
    first = app_driver.reply(window, lambda: app_driver.send(window, LONG))
    chat_a = window.chat.conversation_id
    window.conversations.new_conversation()
    app_driver.reply(window, lambda: app_driver.send(window, "a different chat"))
    window.conversations.select(chat_a)
    again = app_driver.reply(window, lambda: app_driver.send(window, "and more"))
    # Chat A's first turn was still cached: only the reply's tail and the new message are read again.
    assert again.result.reused_tokens >= first.result.prompt_tokens
    assert again.result.prompt_tokens - again.result.reused_tokens < first.result.prompt_tokens


def test_truncate_the_middle_says_the_first_exchange_is_still_remembered(app_driver, tiny_model_dir):
    window = app_driver.open(tiny_model_dir)
    panel, view = window.settings_panel, window.chat.view
    app_driver.wait_planned(window)
    panel.policy.setCurrentIndex(panel.policy.findData(TRUNCATE_MIDDLE))
    app_driver.load(window, context_tokens=512)
    panel.max_tokens.setValue(4)
    # A short first exchange, then longer ones: the first stays while the second has to go.
    medium = " ".join(f"memory{i} context{i} tokens{i}" for i in range(13))
    count = window.client.worker._count_tokens
    one = count([{"role": "user", "content": medium}])
    assert 3 * one > 512 - 4 > 2 * one + 40  # three do not fit (4 tokens kept for the reply), two and the head do
    for text in ["Answer in one word.", medium, medium, medium]:
        app_driver.reply(window, lambda: app_driver.send(window, text))
    cid = window.chat.conversation_id
    row, messages = window.store.conversation(cid), window.store.messages(cid)
    assert row.memory_start_id == messages[4].id  # the first long exchange (messages 2 and 3) was dropped
    for _ in range(2):  # as sent, and as shown again after switching away and back
        marker = view.memory_marker
        assert marker is not None and "first exchange" in marker.text()
        column = view._column
        assert column.indexOf(view.widgets[2]) <= column.indexOf(marker)  # below the first exchange
        kept = next(w for w in view.widgets if w.message.id == row.memory_start_id)
        assert column.indexOf(kept) == column.indexOf(marker) + 1
        window.conversations.new_conversation()
        window.conversations.select(cid)


def test_sampling_starts_from_the_models_generation_config_and_resets_to_it(app_driver, tiny_model_dir, tmp_path):
    import json
    import shutil

    model = tmp_path / "tuned-model"
    shutil.copytree(tiny_model_dir, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
         "repetition_penalty": 1.05, "max_new_tokens": 300}))
    window = app_driver.open(model)
    app_driver.wait_planned(window)
    form = window.settings_panel.sampling
    values = lambda: (form.temperature.value(), form.top_p.value(), form.top_k.value(),  # noqa: E731
                      form.repetition_penalty.value(), form.max_tokens.value())
    sent = lambda: window.chat.settings.sampling  # noqa: E731
    assert values() == (0.6, 0.9, 20, 1.05, 300)
    form.temperature.setValue(1.3)
    form.top_k.setValue(77)
    assert sent().temperature == 1.3
    assert form.preset.currentText() == "Custom"
    form.reset_button.click()
    assert values() == (0.6, 0.9, 20, 1.05, 300)
    assert sent().temperature == 0.6 and sent().top_k == 20  # and what is sent
    assert form.preset.currentText() == "The model's defaults"

    form.preset.setCurrentIndex(form.preset.findText("Creative"))
    form.preset.activated.emit(form.preset.currentIndex())  # as a pick from the list does
    creative = SAMPLING_PRESETS["Creative"]
    assert (sent().temperature, sent().top_k) == (creative["temperature"], creative["top_k"])
    assert form.max_tokens.value() == 300  # a preset leaves the length alone
    form.min_p.setValue(0.5)
    assert form.preset.currentText() == "Custom"


def test_a_greedy_generation_config_means_temperature_zero(tmp_path):
    import json

    from stowage.app.model_settings import ModelSettings, model_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "max_new_tokens": "lots"}))
    defaults = model_defaults(tmp_path)
    assert defaults.sampling.temperature == 0.0
    assert defaults.sampling.max_tokens == ModelSettings().sampling.max_tokens  # a value of the wrong type is ignored
    assert model_defaults(tmp_path / "nowhere") == ModelSettings()
