"""The chat panel on a stand-in engine client whose signals the test emits: saving as a reply streams, errors."""

import sqlite3

import pytest
from PySide6.QtCore import QObject, Signal

from stowage.app import streaming_reply
from stowage.app.chat_panel import ChatPanel
from stowage.app.store import ConversationStore
from stowage.app.worker import Reply, ReplyStarted
from stowage.engine.runtime.generation import GenerationResult


class FakeWorker(QObject):
    reply_started = Signal(object)
    token = Signal(int, str)
    reply_finished = Signal(object)
    reply_failed = Signal(int, str)
    conversation_full = Signal(int)
    tool_calls = Signal(int, object)
    prefill_progress = Signal(int, int, int)  # conversation_id, done, total


class FakeClient(QObject):
    """EngineClient's face towards the chat panel; the test plays the engine by emitting the worker's signals."""

    def __init__(self):
        super().__init__()
        self.worker = FakeWorker()
        self.requests = []
        self.stopped = False
        self.worker.reply_finished.connect(lambda *_: self.requests.clear())
        self.worker.reply_failed.connect(lambda *_: self.requests.clear())

    def chat(self, request):
        self.requests.append(request)

    def stop(self):
        self.stopped = True

    @property
    def is_generating(self):
        return bool(self.requests)


@pytest.fixture
def panel(qtbot, tmp_path):
    store = ConversationStore(tmp_path / "c.sqlite3")
    client = FakeClient()
    widget = ChatPanel(store, client)
    qtbot.addWidget(widget)
    widget.set_model_loaded(1024, "fake-model")
    yield widget
    store.close()


def on_disk(panel):
    """The messages of the panel's chat as another process would read the file now."""
    db = sqlite3.connect(panel.store.path)
    try:
        return db.execute("SELECT role, content, meta FROM messages WHERE conversation_id = ? ORDER BY id",
                          (panel.conversation_id,)).fetchall()
    finally:
        db.close()


def ask(panel, text="Count to three"):
    panel.input.setPlainText(text)
    panel.send()
    cid = panel.conversation_id
    panel.client.worker.reply_started.emit(ReplyStarted(cid, 12, 0))
    return cid


def reply(cid, text, reason="stop"):
    # 2 decode steps in 0.2 s (10 tokens/s), 12 prompt tokens in 0.12 s (100 tokens/s)
    return Reply(cid, GenerationResult(text=text, token_ids=[1, 2, 3], completion_tokens=3, finish_reason=reason,
                                       prompt_tokens=12, prefilled_tokens=12, prefill_seconds=0.12,
                                       decode_seconds=0.2, first_token_seconds=0.5))


def test_the_reply_is_written_as_it_streams_and_kept_when_it_fails(panel, monkeypatch):
    monkeypatch.setattr(streaming_reply, "SAVE_INTERVAL_S", 0.0)  # every token written: the test reads no clock
    cid = ask(panel)
    worker = panel.client.worker
    for piece in ("One", ", two"):
        worker.token.emit(cid, piece)
    role, content, meta = on_disk(panel)[-1]
    assert (role, content) == ("assistant", "One, two")
    assert '"finish_reason": "interrupted"' in meta  # what a crash now would leave
    worker.reply_failed.emit(cid, "Out of memory")
    role, content, meta = on_disk(panel)[-1]
    assert content == "One, two" and '"finish_reason": "error"' in meta and "Out of memory" in meta
    assert panel.view.widgets[-1].text == "One, two" and "cut short by an error" in panel.view.widgets[-1].note.text()
    assert not panel.error.isHidden()


def test_partial_saves_wait_for_the_interval_and_the_end_writes_the_whole_reply(panel, monkeypatch):
    monkeypatch.setattr(streaming_reply, "SAVE_INTERVAL_S", 1e9)  # no second write before the end
    cid = ask(panel)
    worker = panel.client.worker
    for piece in ("One", ", two", ", three"):
        worker.token.emit(cid, piece)
    assert on_disk(panel)[-1][1] == "One"  # the row is made at the first token
    worker.reply_finished.emit(reply(cid, "One, two, three", "cancelled"))
    rows = on_disk(panel)
    assert [r[0] for r in rows] == ["user", "assistant"]
    assert rows[-1][1] == "One, two, three" and '"finish_reason": "cancelled"' in rows[-1][2]


def test_switching_back_to_a_streaming_chat_shows_the_reply_once(panel):
    cid = ask(panel)
    panel.client.worker.token.emit(cid, "One")
    panel.show_conversation(None)
    panel.show_conversation(cid)
    assert [w.message.role for w in panel.view.widgets] == ["user", "assistant"]
    assert panel.view.reply_text == "One"


def test_a_deleted_chat_gets_no_more_writes(panel):
    cid = ask(panel)
    panel.client.worker.token.emit(cid, "One")
    panel.store.delete(cid)
    panel.conversation_deleted(cid)
    assert panel.client.stopped
    panel.client.worker.token.emit(cid, ", two")
    panel.client.worker.reply_finished.emit(reply(cid, "One, two", "cancelled"))
    assert panel.store.conversations() == []


def test_a_chat_has_its_own_system_prompt_or_follows_the_default(panel):
    from dataclasses import replace

    panel.set_settings(replace(panel.settings, system_prompt="Be brief."))
    cid = ask(panel, "first")
    assert panel.client.requests[-1].system == [{"role": "system", "content": "Be brief."}]
    assert "(default): Be brief." in panel.system_prompt.summary.text()
    panel.client.worker.reply_finished.emit(reply(cid, "ok"))
    bar = panel.system_prompt
    bar.edit_button.click()
    bar.editor.setPlainText("Answer in French.")
    bar.save_button.click()
    assert panel.store.conversation(cid).system_prompt == "Answer in French."
    assert "this chat's own" in bar.summary.text()
    ask(panel, "second")
    assert panel.client.requests[-1].system == [{"role": "system", "content": "Answer in French."}]
    panel.client.worker.reply_finished.emit(reply(cid, "d'accord"))
    panel.show_conversation(None)
    panel.show_conversation(cid)  # kept with the chat
    assert bar.own == "Answer in French."
    bar.edit_button.click()
    bar.default_button.click()
    assert panel.store.conversation(cid).system_prompt is None and bar.prompt == "Be brief."


def test_the_prompt_bar_shows_tokens_done_of_all_until_the_first_token(panel, qtbot):
    panel.show()
    cid = ask(panel, "a long document")
    worker, bar = panel.client.worker, panel.prompt_progress
    assert bar.isHidden()
    worker.prefill_progress.emit(cid, 512, 4400)
    assert bar.isVisible() and (bar.value(), bar.maximum()) == (512, 4400)
    assert bar.format().startswith("Reading the prompt: 512 / 4,400 tokens · about ") and bar.format().endswith(" left")
    worker.prefill_progress.emit(cid + 1, 1024, 4400)  # another chat's prompt is not this one's
    assert bar.value() == 512
    worker.prefill_progress.emit(cid, 4096, 4400)
    assert bar.value() == 4096
    worker.token.emit(cid, "Summary")
    assert bar.isHidden()


def test_a_prompt_read_in_one_chunk_shows_no_bar(panel):
    panel.show()
    cid = ask(panel)
    panel.client.worker.prefill_progress.emit(cid, 40, 40)
    assert panel.prompt_progress.isHidden()


def test_a_chat_is_titled_with_the_words_of_its_first_message_not_its_markdown(panel):
    cid = ask(panel, "## **Bold** plan with `code` and [a link](https://example.com)")
    assert panel.store.conversation(cid).title == "Bold plan with code and a link"


def test_a_preset_sets_a_chats_system_prompt_and_sampling_and_is_kept(panel, tmp_path):
    from dataclasses import replace

    from stowage.app.store import ConversationStore

    panel.set_settings(replace(panel.settings, system_prompt="Be kind."))
    panel.system_prompt._finish("You write Python.")  # this chat's own prompt, as Edit then Save sets it
    cid = panel.conversation_id
    panel.set_settings(replace(panel.settings, sampling=replace(panel.settings.sampling, temperature=0.2, top_k=7)))
    coder = panel.save_preset("Coder")
    assert panel.system_prompt.preset.currentText() == "Coder"
    panel.set_settings(replace(panel.settings, sampling=replace(panel.settings.sampling, temperature=1.5, top_k=99)))

    panel.show_conversation(None)  # a new chat: no preset, the default prompt
    assert panel.system_prompt.preset.currentText() == "No preset" and panel.system_prompt.prompt == "Be kind."
    panel.system_prompt.preset.setCurrentIndex(panel.system_prompt.preset.findText("Coder"))
    panel.system_prompt.preset.activated.emit(panel.system_prompt.preset.currentIndex())  # as a pick does
    new = panel.conversation_id
    assert new != cid and panel.store.conversation(new).preset_id == coder
    assert panel.system_prompt.prompt == "You write Python." and "Coder" in panel.system_prompt.summary.toolTip() + \
        panel.system_prompt._line
    ask(panel, "Write a loop")
    request = panel.client.requests[-1]
    assert request.system == [{"role": "system", "content": "You write Python."}]
    assert (request.sampling.temperature, request.sampling.top_k) == (0.2, 7)  # the preset's, not the settings'

    reopened = ConversationStore(panel.store.path)  # kept in the file
    assert reopened.conversation(new).preset_id == coder and reopened.preset(coder).sampling["top_k"] == 7
    reopened.close()
