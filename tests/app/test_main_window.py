"""The whole window on a tiny real model: load, stream, stop, persist, survive a broken folder."""

import os
import threading
import time
import weakref
from pathlib import Path

import pytest
from processes import alive
from PySide6.QtCore import QMetaObject, Qt, QTimer

from stowage.app.store import ConversationStore


@pytest.fixture
def window(app_driver, tiny_model_dir):
    return app_driver.open(tiny_model_dir)


def test_first_run_preselects_and_plans_the_first_model(window, app_driver, tiny_model_dir):
    app_driver.wait_planned(window)
    panel = window.settings_panel
    assert panel.model_combo.currentData() == str(tiny_model_dir)
    assert panel.plan.fits
    assert "layers on CPU" in window.plan_label.text()
    assert window.device_label.text()
    assert window.windowTitle() == "Stowage"


def test_reply_streams_into_the_view_and_is_stored(window, app_driver):
    app_driver.load(window)
    assert window.settings_panel.template_label.text() == "Chat template: the model's own"
    assert window.windowTitle() == f"Stowage — {Path(window.loaded_dir).name}"
    window.settings_panel.max_tokens.setValue(150)  # long enough to outlast a few redraws
    tokens, events = [], []
    window.chat.view.reply_rendered.connect(tokens.append)

    def hold(*_):  # in the engine thread, at its 1st and 10th token: go on once the view drew the reply again
        events.append(None)
        if len(events) in (1, 10):
            wanted, deadline = len(events) // 10 + 1, time.monotonic() + 20
            while len(tokens) < wanted and time.monotonic() < deadline:  # the decode step outruns a redraw
                time.sleep(0.005)

    window.client.worker.token.connect(hold, Qt.ConnectionType.DirectConnection)
    reply = app_driver.reply(window, lambda: app_driver.send(window, "Hello there"))
    assert window.chat.input.toPlainText() == ""
    assert len(tokens) > 1, "the reply should show up piece by piece while it streams"
    assert all(reply.result.text.startswith(t) for t in tokens)
    shown = window.chat.view.widgets[-1]
    assert shown.message.role == "assistant" and shown.text == reply.result.text
    stored = window.store.messages(window.chat.conversation_id)
    assert [m.role for m in stored] == ["user", "assistant"]
    assert stored[1].content == reply.result.text
    assert f"/ {1024:,} tokens" in window.chat.counter.text()
    assert "tokens/s" in window.chat.counter.text()
    # What export needs to say how the reply came about: the model, the sampling, when.
    assert stored[1].meta["model"] == Path(window.loaded_dir).name
    assert stored[1].meta["sampling"]["temperature"] == 0.0 and stored[1].meta["sampling"]["seed"] == 1
    assert stored[1].created >= stored[0].created > 0
    # Under the reply: how long the prompt took to first token, and both speeds.
    assert stored[1].meta["first_token_s"] > 0 and stored[1].meta["prompt_tokens_per_s"] > 0
    note = shown.note.text()
    assert "s to first token" in note and "prompt tokens/s" in note and f"{stored[1].meta['tokens_per_s']:.1f} tokens/s" in note


def test_stop_stops_the_reply(window, app_driver, qtbot):
    app_driver.load(window)
    window.settings_panel.max_tokens.setValue(900)

    def send_then_stop():
        app_driver.send(window, "Tell me a long story")
        qtbot.waitUntil(lambda: len(window.chat.view.reply_text) > 3, timeout=app_driver.timeout_ms)
        assert window.chat.stop_button.isEnabled()
        qtbot.mouseClick(window.chat.stop_button, Qt.MouseButton.LeftButton)

    reply = app_driver.reply(window, send_then_stop)
    assert reply.result.finish_reason == "cancelled"
    assert reply.result.completion_tokens < 900
    assert window.chat.send_button.isEnabled() and not window.chat.stop_button.isEnabled()
    assert window.store.messages(window.chat.conversation_id)[-1].meta["finish_reason"] == "cancelled"
    assert "stopped" in window.chat.view.widgets[-1].note.text()


def test_conversation_is_in_sqlite_after_close_and_reopen(app_driver, tiny_model_dir):
    window = app_driver.open(tiny_model_dir)
    app_driver.load(window)
    window.settings_panel.max_tokens.setValue(8)
    reply_text = app_driver.reply(window, lambda: app_driver.send(window, "Remember me")).result.text
    path = window.store.path
    window.close()

    assert [m.content for m in ConversationStore(path).messages(window.chat.conversation_id)] == ["Remember me", reply_text]
    again = app_driver.open(tiny_model_dir)
    assert again.conversations.list.count() == 1
    assert again.conversations.list.currentItem().text() == "Remember me"
    assert [w.text for w in again.chat.view.widgets] == ["Remember me", reply_text]


def test_broken_model_folder_shows_an_error_and_the_window_survives(window, app_driver, qtbot, broken_model_dir,
                                                                     tiny_model_dir):
    panel = window.settings_panel
    app_driver.wait_planned(window)
    window.chat.input.setPlainText("half-typed thought")
    window.choose_model(str(broken_model_dir))
    qtbot.waitUntil(lambda: window.error_box is not None, timeout=app_driver.timeout_ms)
    assert window.error_box.isVisible()
    assert "broken-model cannot be used" in window.error_box.text()
    assert "truncated or corrupted" in window.error_box.informativeText()
    assert window.error_box.informativeText().startswith(panel.model_info.text())
    assert not panel.plan_bar.isVisible()
    assert not panel.load_button.isEnabled()
    assert window.isVisible()
    assert window.chat.input.toPlainText() == "half-typed thought"
    # The app keeps working: the good model still loads.
    window.error_box.close()
    window.choose_model(str(tiny_model_dir))
    app_driver.load(window)
    assert window.chat.input.toPlainText() == "half-typed thought"


class GuiTicks:
    """Counts ticks of a 0 ms QTimer on the GUI thread (it runs whenever the event loop is free)."""

    def __init__(self, num_ticks: int):
        self.num_ticks = num_ticks
        self.count = 0
        self.reached = threading.Event()
        self.timer = QTimer()
        self.timer.setInterval(0)
        self.timer.timeout.connect(self._tick)

    def _tick(self) -> None:
        self.count += 1
        if self.count >= self.num_ticks:
            self.reached.set()
            self.timer.stop()


def hold_engine_until_gui_ticks(signal, num_ticks: int, resumed: list):
    """At `signal`'s first emission, stop the emitting (engine) thread until the GUI ran `num_ticks` timer ticks.

    Were the engine's work on the GUI thread, the ticks could never come: the wait would give up and
    `resumed` would hold False. No clock is read; the 20 s limit only keeps a broken build from hanging.
    """
    ticks = GuiTicks(num_ticks)

    def hold(*_):
        if resumed:
            return
        QMetaObject.invokeMethod(ticks.timer, "start", Qt.ConnectionType.QueuedConnection)
        resumed.append(threading.get_ident() != threading.main_thread().ident and ticks.reached.wait(20))

    signal.connect(hold, Qt.ConnectionType.DirectConnection)
    return ticks


def test_event_loop_runs_while_the_engine_loads_and_generates(window, app_driver):
    worker = window.client.worker
    during_load, during_reply = [], []
    load_ticks = hold_engine_until_gui_ticks(worker.load_progress, 20, during_load)
    reply_ticks = hold_engine_until_gui_ticks(worker.token, 20, during_reply)
    app_driver.load(window, context_tokens=2048)
    assert during_load == [True] and load_ticks.count >= 20
    window.settings_panel.max_tokens.setValue(50)
    reply = app_driver.reply(window, lambda: app_driver.send(window, "Write something long"))
    assert during_reply == [True] and reply_ticks.count >= 20
    assert reply.result.completion_tokens > 1  # the reply went on after the hold


@pytest.fixture(params=["child", "in-process"])
def engine_mode(request, monkeypatch):
    """The app's engine in its child process (the default), and in the worker's thread (STOWAGE_ENGINE_PROCESS=0)."""
    from stowage.app import worker

    monkeypatch.setattr(worker, "ENGINE_PROCESS", request.param == "child")
    return request.param


def test_unload_frees_the_model(engine_mode, app_driver, tiny_model_dir, qtbot):
    window = app_driver.open(tiny_model_dir)
    app_driver.load(window)
    assert not window.settings_panel.template_label.isHidden()
    worker = window.client.worker
    if engine_mode == "child":
        pid = worker.process.pid
        assert pid != os.getpid() and alive(pid)
    else:
        engine = worker.engine
        # Weak references to what the model holds: after Unload nothing in the app may keep them alive.
        held = [weakref.ref(engine), weakref.ref(engine.cache.k_cache[0]), weakref.ref(engine.model)]
        del engine
    qtbot.mouseClick(window.settings_panel.unload_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.loaded_dir is None, timeout=app_driver.timeout_ms)
    assert worker.engine is None and worker.process is None
    if engine_mode == "child":
        assert not alive(pid)  # the child has exited: all of its memory is back with the system
    else:
        assert [ref() for ref in held] == [None, None, None]
    assert window.windowTitle() == "Stowage"
    assert not window.settings_panel.unload_button.isEnabled()
    assert window.settings_panel.template_label.isHidden()
    app_driver.send(window, "anyone there?")
    assert window.chat.error.isVisible() and "No model is loaded" in window.chat.error.text()
    assert window.chat.input.toPlainText() == "anyone there?"  # kept for after the next load


def test_loading_again_frees_the_first_model(engine_mode, app_driver, tiny_model_dir, qtbot):
    window = app_driver.open(tiny_model_dir)
    app_driver.load(window, context_tokens=1024)
    worker = window.client.worker
    if engine_mode == "child":
        first_pid = worker.process.pid
    else:
        first = weakref.ref(worker.engine)
    window.loaded_dir = None  # what the test waits on below
    app_driver.load(window, context_tokens=2048)
    if engine_mode == "child":
        assert not alive(first_pid) and worker.process.pid != first_pid
        assert worker.process.server.models()[0]["max_model_len"] == 2048
    else:
        assert first() is None
        assert worker.engine.plan.context_tokens == 2048
    assert f"/ {2048:,} tokens" in window.chat.counter.text()


def test_a_corrupt_history_is_moved_aside_and_said_so_at_start(app_driver, tiny_model_dir, isolated_user_files, qtbot):
    isolated_user_files.mkdir(parents=True, exist_ok=True)
    (isolated_user_files / "conversations.sqlite3").write_bytes(b"not a database, " * 512)
    window = app_driver.open(tiny_model_dir)
    [moved] = isolated_user_files.glob("conversations.sqlite3.broken-*")
    qtbot.waitUntil(lambda: window.history_box is not None and window.history_box.isVisible())
    assert moved.name in window.history_box.informativeText()
    assert "new one was started" in window.history_box.informativeText()
    assert window.isVisible()
    # The window keeps working behind the dialog, on a fresh history.
    app_driver.load(window)
    window.settings_panel.max_tokens.setValue(4)
    app_driver.reply(window, lambda: app_driver.send(window, "after the move"))
    assert [m.content for m in window.store.messages(window.chat.conversation_id)][0] == "after the move"


def choose_folder(window, folder):
    """What Folder… does once the user picked `folder` in the dialog."""
    window.settings_panel.select_model_dir(str(folder))
    window.settings_panel.model_chosen.emit(str(folder))


def test_a_folder_that_fails_to_open_leaves_the_model_list(window, app_driver, qtbot, broken_model_dir):
    combo = window.settings_panel.model_combo
    app_driver.wait_planned(window)
    count = combo.count()
    choose_folder(window, broken_model_dir)
    qtbot.waitUntil(lambda: window.error_box is not None, timeout=app_driver.timeout_ms)
    assert combo.findData(str(broken_model_dir)) < 0 and combo.count() == count
    assert combo.currentData() is None  # "Choose a model…", not a model that is not the chosen one


def test_a_folder_opened_with_folder_is_offered_after_a_restart(app_driver, tiny_model_dir, tmp_path, qtbot):
    import shutil

    other = tmp_path / "my-own-model"
    shutil.copytree(tiny_model_dir, other)
    window = app_driver.open(tiny_model_dir)
    app_driver.wait_planned(window)
    choose_folder(window, other)
    qtbot.waitUntil(lambda: window.qsettings.value("last_model") == str(other), timeout=app_driver.timeout_ms)
    window.choose_model(str(tiny_model_dir))  # the folder is not the last model used
    window.settings_panel.select_model_dir(str(tiny_model_dir))
    qtbot.waitUntil(lambda: window.qsettings.value("last_model") == str(tiny_model_dir), timeout=app_driver.timeout_ms)
    window.close()
    again = app_driver.open(tiny_model_dir)
    assert again.settings_panel.model_combo.findData(str(other)) > 0


def test_menu_bar_has_file_edit_view_help_and_about_says_versions_and_where_data_is(window, qtbot,
                                                                                   isolated_user_files):
    import PySide6

    menus = [action.text().replace("&", "") for action in window.menuBar().actions()]
    assert menus == ["File", "Edit", "View", "Help"]
    window.about_action.trigger()
    box = window.about_box
    assert box is not None and box.isVisible()
    text = box.informativeText()
    assert PySide6.__version__ in text and "Python" in text and "torch" in text
    assert "CPU decode step: " in text  # which kernels run (issue 16)
    assert str(isolated_user_files / "conversations.sqlite3") in text
    assert str(isolated_user_files / "models") in text


def test_ctrl_q_quits(window, qtbot):
    from PySide6.QtGui import QKeySequence

    assert window.quit_action.shortcut() == QKeySequence("Ctrl+Q")
    window.activateWindow()
    qtbot.waitUntil(window.isActiveWindow)
    qtbot.keyClick(window, Qt.Key.Key_Q, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: not window.isVisible())
    assert not window.client.thread.isRunning()  # closing freed the engine thread


def test_ctrl_n_still_starts_a_chat_with_the_menu_there(window, qtbot):
    window.activateWindow()
    qtbot.waitUntil(window.isActiveWindow)
    qtbot.keyClick(window, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    assert len(window.store.conversations()) == 1


def test_nothing_on_the_right_is_cut_off_in_a_1000_by_700_window(app_driver, tiny_model_dir, qtbot):
    from stowage.app.main_window import MainWindow
    from stowage.app.model_catalog import ModelEntry

    entry = ModelEntry("HuggingFaceTB/SmolLM2-135M-Instruct (Hugging Face cache)", tiny_model_dir, "hf")
    window = MainWindow(models=[entry])
    app_driver.windows.append(window)
    qtbot.addWidget(window)
    window.resize(1000, 700)
    window.show()
    app_driver.wait_planned(window)
    panel = window.settings_panel
    qtbot.waitUntil(lambda: panel.scroll.widget().width() > 0)
    assert window.minimumSizeHint().width() <= 1000 and window.width() == 1000
    # The panel's scroll area has no horizontal scroll bar: content wider than it would be cut at its right edge.
    assert panel.scroll.widget().minimumSizeHint().width() <= panel.scroll.viewport().width()
    assert panel.mapTo(window, panel.rect().topRight()).x() < window.width()
    # Still so with a model loaded and a reply on screen (the counter and the reply's figures are long).
    app_driver.load(window)
    panel.max_tokens.setValue(4)
    app_driver.reply(window, lambda: app_driver.send(window, "hello"))
    qtbot.wait(50)
    assert window.minimumSizeHint().width() <= 1000 and window.width() == 1000
    assert panel.mapTo(window, panel.rect().topRight()).x() < window.width()


def test_graph_legends_do_not_cover_the_lines(window):
    for plot in (window.graph.ram_plot, window.graph.vram_plot):
        assert plot.getPlotItem().legend is None
    assert "system used" in window.graph.ram_plot.getPlotItem().titleLabel.text


def test_settings_changed_after_load_say_they_wait_for_the_next_load(window, app_driver, qtbot):
    panel = window.settings_panel
    app_driver.load(window, context_tokens=1024)
    assert not panel.pending.isVisible()
    panel.context.spin.setValue(2048)
    assert panel.pending.isVisible() and "Load" in panel.pending.text() and "1,024" in panel.pending.text()
    assert "1,024-token" in window.plan_label.text()  # the status bar tells what is loaded, not the forecast
    assert f"/ {1024:,} tokens" in window.chat.counter.text()
    panel.context.spin.setValue(1024)  # back to what is loaded: nothing waits
    assert not panel.pending.isVisible()
    panel.context.spin.setValue(2048)
    window.loaded_dir = None
    qtbot.mouseClick(panel.load_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.loaded_dir is not None, timeout=app_driver.timeout_ms)
    assert not panel.pending.isVisible()
    assert "2,048-token" in window.plan_label.text()


def test_ctrl_f_goes_to_the_chat_search(window, qtbot):
    window.activateWindow()
    qtbot.waitUntil(window.isActiveWindow)
    qtbot.keyClick(window, Qt.Key.Key_F, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(window.conversations.search.hasFocus)


def test_a_reply_in_progress_is_in_the_sqlite_file_before_it_ends(window, app_driver, qtbot):
    app_driver.load(window)
    window.settings_panel.max_tokens.setValue(20)
    held, release = threading.Event(), threading.Event()

    def hold(*_):  # in the engine thread: the reply cannot end while it waits here
        if not held.is_set():
            held.set()
            release.wait(30)

    window.client.worker.token.connect(hold, Qt.ConnectionType.DirectConnection)
    app_driver.send(window, "Hello there")
    cid = window.chat.conversation_id

    def partial_on_disk():
        other = ConversationStore(window.store.path)  # as another process (or the next start) reads the file
        try:
            return [m for m in other.messages(cid) if m.role == "assistant"]
        finally:
            other.close()

    try:
        qtbot.waitUntil(lambda: bool(partial_on_disk()), timeout=app_driver.timeout_ms)
        (partial,) = partial_on_disk()
        assert partial.meta["finish_reason"] == "interrupted" and window.client.is_generating
    finally:
        release.set()
    # reply_finished reaches the client (is_generating) and the chat panel (which stores the reply) as two queued
    # calls; the wait may run between them, so it waits for the stored reply itself
    qtbot.waitUntil(lambda: not window.client.is_generating
                    and partial_on_disk()[0].meta["finish_reason"] != "interrupted", timeout=app_driver.timeout_ms)
    (final,) = partial_on_disk()
    assert final.id == partial.id and final.meta["finish_reason"] != "interrupted"
