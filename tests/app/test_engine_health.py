"""Issue 30, item 10: an engine child that dies while nothing is asked of it is noticed (a health check in the
engine's thread), not at the next message."""

import os
import signal

from processes import TIMEOUT_S


def test_an_engine_that_dies_while_idle_is_noticed(app_driver, qtbot, tiny_model_dir):
    window = app_driver.open(tiny_model_dir)
    app_driver.load(window)
    assert "loaded" in window.model_label.text()
    os.kill(window.client.worker.process.pid, signal.SIGKILL)  # the out-of-memory killer, say; no message is sent
    qtbot.waitUntil(lambda: window.loaded_dir is None, timeout=TIMEOUT_S * 1000)
    assert window.model_label.text() == "No model loaded"
    assert window.error_box is not None and "The engine stopped" in window.error_box.text()
    assert "Press Load" in window.error_box.informativeText()
    assert window.settings_panel.load_button.isEnabled()  # Load starts it again
