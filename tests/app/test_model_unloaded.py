"""The engine child unloads its model when a weights file changes under it; the window says so and offers Load."""

import shutil

from processes import TIMEOUT_S


def test_a_weights_file_truncated_under_the_engine_unloads_the_model_in_the_window(app_driver, qtbot, tiny_model_dir,
                                                                                   tmp_path):
    # Caught: the child, still alive, unloaded its model, but the window kept saying "loaded" and every message
    # failed with the server's "no model is loaded ... POST /stowage/load" (review finding 7).
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    window = app_driver.open(model_dir)
    app_driver.load(window)
    window.settings_panel.max_tokens.setValue(3)
    chat = window.chat
    app_driver.reply(window, lambda: app_driver.send(window, "Hello"))
    assert "loaded" in window.model_label.text()
    weights = model_dir / "model.safetensors"
    with open(weights, "r+b") as f:  # an interrupted copy over it, say
        f.truncate(weights.stat().st_size // 2)

    app_driver.send(window, "Are you there?")
    # the unload and the message's failure are two signals from the worker's thread: wait for both to be delivered
    qtbot.waitUntil(lambda: window.loaded_dir is None and chat.error.isVisible(), timeout=TIMEOUT_S * 1000)
    assert window.model_label.text() == "No model loaded"
    assert window.settings_panel.load_button.isEnabled()
    box = window.error_box
    assert box is not None and "The model was unloaded" in box.text()
    assert "model.safetensors" in box.informativeText() and "Press Load" in box.informativeText()
    assert chat.error.isVisible() and "Press Load" in chat.error.text()  # the message's failure says the same
    assert "/stowage/load" not in chat.error.text()
    assert window.client.worker.process is None  # the child serving nothing is ended

    # The next message is kept and asks for a model, as with none loaded.
    chat.input.setPlainText("And now?")
    chat.send()
    assert "No model is loaded" in chat.error.text() and chat.input.toPlainText() == "And now?"
