"""The "Remote server" model source against a live `stowage serve` subprocess on 127.0.0.1 (real HTTP, no mock)."""

import signal
from pathlib import Path

import pytest
from processes import SERVE_KEY, TIMEOUT_S
from PySide6.QtCore import Qt

from stowage.app.remote_source import RemoteModel, ServerBook, TokenEstimate

KEY = SERVE_KEY


def stop(proc):
    """End the server now, in the middle of a test (the fixture's teardown then finds it ended)."""
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=TIMEOUT_S)


def remote_entries(window):
    combo = window.settings_panel.model_combo
    return [combo.itemData(i) for i in range(combo.count()) if isinstance(combo.itemData(i), RemoteModel)]


def test_a_servers_model_is_listed_chats_and_stores_its_reply(app_driver, qtbot, tiny_model_dir, server):
    _, url = server
    window = app_driver.open(tiny_model_dir)
    app_driver.load(window)  # a local model first: connecting to the server unloads it
    panel = window.settings_panel
    app_driver.add_server(window, url)
    qtbot.waitUntil(lambda: panel.remote is not None, timeout=TIMEOUT_S * 1000)
    assert "press Connect to use" in panel.pending.text()
    (model,) = remote_entries(window)
    assert model == RemoteModel(url, tiny_model_dir.name, 512)
    assert panel.model_combo.currentData() == model and "server 127.0.0.1:" in panel.model_combo.currentText()
    assert "512 tokens (the server's max_model_len)" in panel.model_info.text()
    # nothing is known about that machine's memory: no forecast, no slider, no graphs
    assert not panel.plan_bar.isVisible() and not panel.context.isVisible() and not window.graph.isVisible()
    assert panel.policy.isVisible() and panel.load_button.text() == "Connect"
    assert window.forecast is None and panel.plan is None

    qtbot.mouseClick(panel.load_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.loaded_remote is not None, timeout=TIMEOUT_S * 1000)
    assert window.chat.context_tokens == 512 and panel.serve.endpoint is None  # Serve is for a local model
    assert window.loaded_dir is None and window.client.worker.process is None  # the local engine was ended
    panel.temperature.setValue(0.0)
    panel.max_tokens.setValue(6)
    tokens = []
    window.client.worker.token.connect(lambda cid, text: tokens.append(text))
    reply = app_driver.reply(window, lambda: app_driver.send(window, "Hello there"))
    assert reply.result.finish_reason in ("stop", "length") and reply.result.text == "".join(tokens) and tokens
    assert reply.result.prompt_tokens > 0 and reply.result.completion_tokens >= 1  # the server's usage
    (cid,) = [c.id for c in window.store.conversations()]
    stored = window.store.messages(cid)
    assert [m.role for m in stored] == ["user", "assistant"] and stored[-1].content == reply.result.text
    assert stored[-1].meta["model"] == tiny_model_dir.name

    # the next window offers the server's model again (its key was not remembered)
    window.close()
    again = app_driver.open(tiny_model_dir)
    assert remote_entries(again) == [model]
    # the model used last is chosen and its server asked again: without the key it was not given, it refuses
    qtbot.waitUntil(lambda: "refused the API key" in again.settings_panel.model_info.text(), timeout=TIMEOUT_S * 1000)
    assert "Check the address and key with Server…" in again.settings_panel.model_info.text()
    assert KEY not in Path(window.qsettings.fileName()).read_text()  # written nowhere in the settings file
    # Forget server: out of the list, and out of the next window's
    picker = again.settings_panel.picker
    assert picker.forget_button.isVisible()
    qtbot.mouseClick(picker.forget_button, Qt.MouseButton.LeftButton)
    assert not remote_entries(again) and "is forgotten" in picker.info.text() and not picker.forget_button.isVisible()
    again.close()
    assert not remote_entries(app_driver.open(tiny_model_dir))


def test_a_server_that_does_not_answer_is_a_message_and_the_window_goes_on(app_driver, qtbot, tiny_model_dir):
    window = app_driver.open(tiny_model_dir)
    app_driver.wait_planned(window)
    panel = window.settings_panel
    app_driver.add_server(window, "http://127.0.0.1:9", key="")
    qtbot.waitUntil(lambda: "cannot reach" in panel.model_info.text(), timeout=TIMEOUT_S * 1000)
    assert "is the server running at that address?" in panel.model_info.text()
    assert "Server…" in panel.model_info.text() and not remote_entries(window)
    # the window keeps working: the local model plans, loads and answers
    panel.model_combo.setCurrentIndex(1)
    window.choose_model(str(tiny_model_dir))
    qtbot.waitUntil(lambda: panel.plan is not None and panel.plan_bar.isVisible())
    assert window.graph.isVisible()
    app_driver.load(window)
    panel.max_tokens.setValue(3)
    reply = app_driver.reply(window, lambda: app_driver.send(window, "Hi"))
    assert reply.result.text


def test_a_server_gone_mid_session_is_an_error_in_the_chat(app_driver, qtbot, tiny_model_dir, server):
    proc, url = server
    window = app_driver.open(tiny_model_dir)
    app_driver.wait_planned(window)
    panel = window.settings_panel
    app_driver.add_server(window, url, remember=True)
    qtbot.waitUntil(lambda: panel.remote is not None, timeout=TIMEOUT_S * 1000)
    assert KEY in window.qsettings.value("remote_servers")  # ticked: remembered (the dialog says unencrypted)
    qtbot.mouseClick(panel.load_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.loaded_remote is not None, timeout=TIMEOUT_S * 1000)
    stop(proc)
    failed = []
    window.client.worker.reply_failed.connect(lambda cid, message: failed.append(message))
    app_driver.send(window, "Anyone there?")
    qtbot.waitUntil(lambda: bool(failed), timeout=TIMEOUT_S * 1000)
    qtbot.waitUntil(window.chat.error.isVisible)
    assert "cannot reach" in failed[0] and "cannot reach" in window.chat.error.text()
    assert window.chat.send_button.isEnabled() and window.isVisible()
    assert window.store.messages(window.chat.conversation_id)[0].content == "Anyone there?"  # kept


def test_a_refused_folder_while_connected_then_the_server_going_away(app_driver, qtbot, tiny_model_dir,
                                                                    broken_model_dir, server):
    """Issue 30: a folder refused while connected leaves no half server-mode panel (item 8); a server that goes away
    while nothing is sent no longer shows "Connected" in green (item 10)."""
    proc, url = server
    window = app_driver.open(tiny_model_dir)
    app_driver.wait_planned(window)
    panel = window.settings_panel
    app_driver.add_server(window, url)
    qtbot.waitUntil(lambda: panel.remote is not None, timeout=TIMEOUT_S * 1000)
    qtbot.mouseClick(panel.load_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.loaded_remote is not None, timeout=TIMEOUT_S * 1000)
    status = panel.loading.load_status
    assert status.text().startswith("Connected") and status.property("theme_role") == "ok"
    assert panel.load_button.text() == "Connect" and not panel.context.isVisible()

    panel.picker.open_path(str(broken_model_dir))  # Open… on a folder that cannot be used
    qtbot.waitUntil(lambda: window.error_box is not None, timeout=TIMEOUT_S * 1000)
    assert panel.remote is None and panel.load_button.text() == "Load" and panel.memory_box.title() == "Memory"
    assert panel.context.isVisible() and not panel.context.isEnabled() and not panel.load_button.isEnabled()
    assert window.graph.isVisible() and not panel.picker.forget_button.isVisible()
    stop(proc)
    # nothing is sent: the health check finds the server gone
    qtbot.waitUntil(lambda: "does not answer" in status.text(), timeout=TIMEOUT_S * 1000)
    assert status.property("theme_role") == "error" and "not answering" in window.model_label.text()


def test_the_estimate_learns_the_servers_count():
    estimate = TokenEstimate()
    messages = [{"role": "user", "content": "x" * 400}]
    assert estimate.count(messages) == 134 + 16  # a third of the characters, and the template's tokens
    estimate.learn(messages, prompt_tokens=116)  # the server counted 100 content tokens: 1 for 4 characters
    assert estimate.tokens_per_char == pytest.approx(0.25 * 1.1)  # with a 10% margin


def test_a_hand_edited_settings_entry_is_dropped(tmp_path):
    from PySide6.QtCore import QSettings

    settings = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    settings.setValue("remote_servers", '[{"url": "http://a:1", "models": [{"id": "m", "max_model_len": 8}]}, '
                                        '{"no": "url"}, 3]')
    book = ServerBook(settings)
    assert book.models() == [RemoteModel("http://a:1", "m", 8)] and book.key_for("http://a:1") is None


def test_a_server_of_another_kind_is_a_message(app_driver, qtbot, tiny_model_dir):
    """A web server that answers /v1/models with JSON of another shape (a real one on 127.0.0.1)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"name": "not an OpenAI model object"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    other = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        window = app_driver.open(tiny_model_dir)
        app_driver.wait_planned(window)
        app_driver.add_server(window, f"http://127.0.0.1:{other.server_port}", key="")
        info = window.settings_panel.model_info
        qtbot.waitUntil(lambda: "did not list models" in info.text(), timeout=TIMEOUT_S * 1000)
        assert "is it an OpenAI-compatible server?" in info.text() and not remote_entries(window)
    finally:
        other.shutdown()
