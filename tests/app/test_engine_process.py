"""The app with its engine in a child process (the default): the engine SIGKILLed in the middle of a reply is a
failed reply; the window, the chat and the partial reply stay, and "Restart engine" starts a fresh child."""

import os
import signal

import pytest
from factory import cpu_plan
from processes import alive
from PySide6.QtCore import Qt

from stowage.app import worker as app_worker
from stowage.app.worker import ChatRequest, EngineClient
from stowage.engine.runtime.sampler import SamplingParams


@pytest.fixture(params=[True, False], ids=["child", "in-process"])
def engine_client(qtbot, request):
    client = EngineClient(use_process=request.param)
    yield client
    client.shutdown()


def test_worker_signals_over_a_child(engine_client, qtbot, tiny_model_dir):
    # the same signals whether the engine runs in a child or in the worker's thread (the prompt's progress too)
    worker, started, begun = engine_client.worker, [], []
    worker.engine_started.connect(started.append)
    worker.load_started.connect(lambda pid, held: begun.append((pid, held)))
    with qtbot.waitSignal(worker.loaded, timeout=60_000):
        engine_client.load(str(tiny_model_dir), cpu_plan(tiny_model_dir, 2048))
    pid = worker.process.pid if worker.use_process else None
    if worker.use_process:
        qtbot.waitUntil(lambda: started == [pid], timeout=10_000)
        assert pid != os.getpid()
    # what the memory graph's baseline is read from: the engine's own process, whatever else this one started
    qtbot.waitUntil(lambda: bool(begun), timeout=10_000)
    assert len(begun) == 1 and begun[0][0] == (pid or os.getpid()) and begun[0][1] > 0
    progress = []
    worker.prefill_progress.connect(lambda *args: progress.append(args))
    long_message = [{"role": "user", "content": "Stowage plans memory. " * 150}]  # more than one 512-token chunk
    with qtbot.waitSignal(worker.reply_finished, timeout=60_000) as done:
        engine_client.chat(ChatRequest(7, [], long_message, SamplingParams(temperature=0, max_tokens=4)))
    reply = done.args[0]
    assert reply.conversation_id == 7 and reply.result.completion_tokens == 4 and reply.result.prompt_tokens > 512
    qtbot.waitUntil(lambda: bool(progress), timeout=10_000)
    assert progress[0] == (7, 512, reply.result.prompt_tokens)
    with qtbot.waitSignal(worker.unloaded, timeout=60_000):
        engine_client.unload()
    assert worker.process is None and (pid is None or not alive(pid))


def test_a_killed_engine_is_a_failed_reply_and_a_new_load_starts_a_fresh_one(app_driver, qtbot, tiny_model_dir,
                                                                            monkeypatch):
    monkeypatch.setattr(app_worker, "ENGINE_PROCESS", True)
    window = app_driver.open(tiny_model_dir)
    app_driver.load(window, context_tokens=2048)
    worker, chat = window.client.worker, window.chat
    first_pid = worker.process.pid
    qtbot.waitUntil(lambda: window.stats.pid == first_pid, timeout=10_000)  # the graphs follow the child
    window.settings_panel.max_tokens.setValue(1500)

    def send_then_kill():
        app_driver.send(window, "Write a long story")
        qtbot.waitUntil(lambda: len(chat.view.reply_text) > 3, timeout=app_driver.timeout_ms)
        os.kill(first_pid, signal.SIGKILL)

    with qtbot.waitSignal(worker.reply_failed, timeout=app_driver.timeout_ms) as failed:
        send_then_kill()
    assert "killed by SIGKILL" in failed.args[1] and "Press Load" in failed.args[1]
    qtbot.waitUntil(lambda: window.loaded_dir is None, timeout=app_driver.timeout_ms)
    assert window.isVisible()
    assert chat.error.isVisible() and "killed by SIGKILL" in chat.error.text()
    [(_, partial)] = [(m.role, m.content) for m in window.store.messages(chat.conversation_id)
                      if m.role == "assistant"]
    assert partial  # the partial reply is kept in the chat
    assert not alive(first_pid)

    box = window.error_box  # the window offers to start the engine again, on the same model and context
    assert box.isVisible() and "killed by SIGKILL" in box.informativeText()
    [restart] = [b for b in box.buttons() if b.text() == "Restart engine"]
    with qtbot.waitSignal(worker.loaded, timeout=app_driver.timeout_ms):
        restart.click()
    assert worker.process.pid != first_pid and worker.context_tokens == 2048  # a fresh child
    qtbot.waitUntil(lambda: window.loaded_dir is not None, timeout=app_driver.timeout_ms)
    window.settings_panel.max_tokens.setValue(4)
    reply = app_driver.reply(window, lambda: app_driver.send(window, "Again"))
    assert reply.result.finish_reason == "length" and reply.result.completion_tokens == 4
    qtbot.mouseClick(window.settings_panel.unload_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.loaded_dir is None, timeout=app_driver.timeout_ms)
