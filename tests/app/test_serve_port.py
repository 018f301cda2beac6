"""Issue 30, items 3 and 7: a Serve port another program holds leaves the loaded model alone; a Serve restart keeps
"Changed since Load" while the panel shows settings that are not loaded."""

import socket

from processes import TIMEOUT_S, free_port


def test_a_taken_port_never_costs_the_model_and_unticking_serve_works(app_driver, qtbot, tiny_model_dir):
    window = app_driver.open(tiny_model_dir)
    worker, serve = window.client.worker, window.settings_panel.serve
    with socket.socket() as other:  # another program listening on the port
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        serve.switch.click()
        serve.port.setValue(port)
        app_driver.load(window)  # Load with the port taken: loaded for the app alone, and said
        qtbot.waitUntil(lambda: "is taken" in serve.note.text(), timeout=TIMEOUT_S * 1000)
        assert f"Port {port}" in serve.note.text() and "stays loaded" in serve.note.text()
        assert worker.process.server.base_url.startswith("unix:")
        pid = worker.process.pid
        serve.switch.click()  # untick: nothing to restart, nothing hangs on "Restarting the engine…"
        assert "this app alone" in serve.note.text() and "Restarting" not in serve.note.text()

        serve.switch.click()  # on again with the port still taken: the working model is not unloaded
        qtbot.waitUntil(lambda: "is taken" in serve.note.text(), timeout=TIMEOUT_S * 1000)
        qtbot.wait(600)  # past Serve's restart timer
        assert window.loaded_dir == str(tiny_model_dir) and worker.process.pid == pid
        assert worker.process.server.health()  # the engine answers on its private socket
        serve.switch.click()
        assert "this app alone" in serve.note.text() and worker.process.pid == pid


def test_changed_since_load_survives_a_serve_restart(app_driver, qtbot, tiny_model_dir):
    window = app_driver.open(tiny_model_dir)
    app_driver.load(window, context_tokens=1024)
    panel = window.settings_panel
    panel.context.spin.setValue(2048)
    assert panel.pending.isVisible() and "Changed since Load" in panel.pending.text()
    pid = window.client.worker.process.pid
    panel.serve.port.setValue(free_port())
    panel.serve.switch.click()
    qtbot.waitUntil(lambda: window.loaded_dir is not None and window.client.worker.process is not None
                    and window.client.worker.process.pid != pid, timeout=TIMEOUT_S * 1000)
    assert window.loaded_plan.context_tokens == 1024 and panel.settings.context_tokens == 2048
    assert panel.pending.isVisible() and "Changed since Load" in panel.pending.text()
