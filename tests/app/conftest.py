"""Shared fixtures for the app tests: offscreen Qt, a temp data folder and QSettings, a tiny real model."""

from __future__ import annotations

import os

# Before anything imports Qt: no display is needed, and none is touched.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random Llama with a byte-level BPE tokenizer and a chat template, saved as safetensors."""
    from factory import make_model  # tests/support: the same tiny models the engine tests use

    return make_model(tmp_path_factory.mktemp("tiny-llama"), "llama", num_hidden_layers=2,
                      intermediate_size=128, max_position_embeddings=4096)


@pytest.fixture
def broken_model_dir(tmp_path, tiny_model_dir):
    """The tiny model with its weight file cut short, as an interrupted download leaves it."""
    import shutil

    model_dir = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, model_dir)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return model_dir


@pytest.fixture(autouse=True)
def isolated_user_files(tmp_path, monkeypatch):
    """Every test gets its own data folder and QSettings file; the user's are never touched."""
    data = tmp_path / "stowage-data"
    monkeypatch.setenv("STOWAGE_DATA_DIR", str(data))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    from PySide6.QtCore import QSettings

    QSettings.setDefaultFormat(QSettings.Format.IniFormat)
    QSettings.setPath(QSettings.Format.IniFormat, QSettings.Scope.UserScope, str(tmp_path / "qsettings"))
    return data


TIMEOUT_MS = 60_000


class AppDriver:
    """Opens real main windows on a model folder and drives them as a user would."""

    timeout_ms = TIMEOUT_MS

    def __init__(self, qtbot):
        self.qtbot = qtbot
        # pytest-qt keeps only a weak reference; a window freed before its close would take a running
        # engine thread with it, so the driver holds each one until teardown closes it.
        self.windows = []

    def open(self, model_dir):
        from stowage.app.main_window import MainWindow
        from stowage.app.model_catalog import ModelEntry

        window = MainWindow(models=[ModelEntry(model_dir.name, model_dir, "folder")])
        self.windows.append(window)
        self.qtbot.addWidget(window)
        window.show()
        return window

    def wait_planned(self, window):
        self.qtbot.waitUntil(lambda: window.settings_panel.plan is not None, timeout=self.timeout_ms)

    def load(self, window, context_tokens=1024):
        """Wait for the chosen model's forecast, set the context and greedy sampling, press Load."""
        from PySide6.QtCore import Qt

        panel = window.settings_panel
        self.wait_planned(window)
        panel.context.spin.setValue(context_tokens)
        panel.temperature.setValue(0.0)  # greedy: the same reply every run
        panel.seed.setValue(1)
        self.qtbot.mouseClick(panel.load_button, Qt.MouseButton.LeftButton)
        # Worker signals reach the window queued; wait for the window's own state, not the raw signal.
        self.qtbot.waitUntil(lambda: window.loaded_dir is not None, timeout=self.timeout_ms)

    def send(self, window, text):
        from PySide6.QtCore import Qt

        window.chat.input.setPlainText(text)
        self.qtbot.keyClick(window.chat.input, Qt.Key.Key_Return)

    def reply(self, window, action):
        """Run `action` and return the Reply it leads to."""
        with self.qtbot.waitSignal(window.chat.reply_done, timeout=self.timeout_ms) as blocker:
            action()
        return blocker.args[0]

    def add_server(self, window, url, key=None, remember=False):
        """Server…, fill in the dialog, OK: as a user adds a server (key: processes.SERVE_KEY, the test servers')."""
        from processes import SERVE_KEY
        from PySide6.QtCore import Qt

        self.qtbot.mouseClick(window.settings_panel.picker.server_button, Qt.MouseButton.LeftButton)
        dialog = window.remotes.dialog
        self.qtbot.waitUntil(dialog.isVisible)
        dialog.url.setText(url + "/v1")
        dialog.key.setText(SERVE_KEY if key is None else key)
        dialog.remember.setChecked(remember)
        self.qtbot.mouseClick(dialog.buttons.button(dialog.buttons.StandardButton.Ok), Qt.MouseButton.LeftButton)

    def connect(self, window, url):
        """Add the server at url and connect to its model, as a user does."""
        from PySide6.QtCore import Qt

        panel = window.settings_panel
        self.wait_planned(window)  # the model the window opened on is planned first
        self.add_server(window, url)
        self.qtbot.waitUntil(lambda: panel.remote is not None, timeout=self.timeout_ms)
        self.qtbot.mouseClick(panel.load_button, Qt.MouseButton.LeftButton)
        self.qtbot.waitUntil(lambda: window.loaded_remote is not None, timeout=self.timeout_ms)

    def close_all(self):
        while self.windows:
            self.windows.pop().close()


@pytest.fixture
def app_driver(qtbot):
    driver = AppDriver(qtbot)
    yield driver
    driver.close_all()


def start_server(model_dir, context=512):
    """`stowage serve` on model_dir, on a loopback port and with processes.SERVE_KEY: (the process, its URL)."""
    from processes import read_line, stowage

    proc = stowage("serve", model_dir, "--port", 0, "--context", context)
    url = read_line(proc)
    if not url.startswith("http://127.0.0.1:"):
        proc.kill()
        pytest.fail(f"no URL on stdout ({url!r}): {proc.communicate()[1]}")
    return proc, url


def stop_server(proc):
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=TIMEOUT_MS / 1000)


@pytest.fixture
def server(tiny_model_dir):
    """A live `stowage serve` on the tiny model for the app to add as a remote source: (process, URL)."""
    proc, url = start_server(tiny_model_dir)
    yield proc, url
    stop_server(proc)

