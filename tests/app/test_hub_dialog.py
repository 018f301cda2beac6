"""File ▸ Get models…, driven offscreen against tests/support/hub_server.py: search, verdicts, download, cancel,
and the downloaded model chosen in the picker."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt

from hub_server import HubServer, Repo
from stowage.app.hub_dialog import HubDialog
from stowage.engine.hub.client import Hub
from stowage.engine.hub.verdict import Verdict
from stowage.engine.planning.inspect import inspect
from stowage.engine.planning.budgets import given_budgets
from stowage.engine.planning.plan import PlanRequest, plan
from stowage.engine.units import GiB

TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from factory import make_model
    from gguf_factory import write_gguf

    root = tmp_path_factory.mktemp("hub-dialog")
    return write_gguf(make_model(root / "st", "llama", num_hidden_layers=2), root / "Tiny-Q8_0.gguf", "q8_0")


@pytest.fixture
def server(tiny_gguf, monkeypatch):
    with HubServer() as hub:
        hub.add(Repo("acme/Tiny-GGUF", {"Tiny-Q8_0.gguf": tiny_gguf}, tags=("gguf", "llama"),
                     gguf_architecture="llama", downloads=3))
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield hub


def open_repo(qtbot, dialog: HubDialog) -> None:
    dialog.search_box.setText("tiny")
    qtbot.mouseClick(dialog.search_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dialog.results.count() == 1, timeout=TIMEOUT_MS)
    dialog.results.setCurrentRow(0)
    qtbot.waitUntil(lambda: 0 in dialog.verdicts, timeout=TIMEOUT_MS)
    dialog.table.selectRow(0)


def test_search_verdict_download(qtbot, server, tiny_gguf):
    dialog = HubDialog(request=PlanRequest(512), budgets=lambda: given_budgets([], 8 * GiB), hub=Hub(server.url))
    qtbot.addWidget(dialog)
    dialog.show()
    open_repo(qtbot, dialog)
    assert dialog.table.item(0, 0).text() == "Tiny-Q8_0.gguf" and dialog.table.item(0, 1).text() == "Q8_0"
    assert dialog.table.item(0, 3).text().startswith("fits in RAM (no GPU) at 512 tokens")
    assert dialog.download_button.isEnabled()
    with qtbot.waitSignal(dialog.downloaded, timeout=TIMEOUT_MS) as finished:
        qtbot.mouseClick(dialog.download_button, Qt.MouseButton.LeftButton)
    path = finished.args[0]
    assert open(path, "rb").read() == tiny_gguf.read_bytes()
    assert dialog.bar.value() == 1000 and "Downloaded" in dialog.progress_label.text()
    # the verdict shown before the download is the plan of the downloaded file: the same bytes per device
    local = plan(inspect(path), PlanRequest(512), given_budgets([], 8 * GiB))
    assert dialog.verdicts[0].plan == local and dialog.table.item(0, 3).text() == Verdict(None, local).text


def test_a_dropped_download_resumes_and_a_corrupt_one_is_refused(qtbot, server, tiny_gguf, tmp_path):
    dialog = HubDialog(request=PlanRequest(512), budgets=lambda: given_budgets([], 8 * GiB), hub=Hub(server.url))
    qtbot.addWidget(dialog)
    dialog.show()
    open_repo(qtbot, dialog)
    server.drop_after["Tiny-Q8_0.gguf"] = 50_000  # after the header was read for the verdict
    before = len(server.requests)
    with qtbot.waitSignal(dialog.downloaded, timeout=TIMEOUT_MS) as finished:
        qtbot.mouseClick(dialog.download_button, Qt.MouseButton.LeftButton)
    assert open(finished.args[0], "rb").read() == tiny_gguf.read_bytes()  # verified by its SHA-256, then linked
    gets = [r for method, p, r, _ in server.requests[before:] if method == "GET" and p.startswith("/cdn-lfs/")]
    assert gets == [None, "bytes=50000-"]  # the rest asked for after the drop

    cache = tmp_path / "hf-cache" / "models--acme--Tiny-GGUF"
    for blob in (cache / "blobs").iterdir():  # a fresh machine: nothing cached
        blob.unlink()
    server.corrupt.add("Tiny-Q8_0.gguf")
    qtbot.mouseClick(dialog.download_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "corrupted on the way" in dialog.progress_label.text(), timeout=TIMEOUT_MS)
    assert not list((cache / "blobs").glob("*[!k]"))  # nothing kept but the lock file
    assert dialog.download_button.isEnabled()


def test_a_download_can_be_cancelled(qtbot, server):
    server.slow["Tiny-Q8_0.gguf"] = 0.05
    dialog = HubDialog(request=PlanRequest(512), budgets=lambda: given_budgets([], 8 * GiB), hub=Hub(server.url))
    qtbot.addWidget(dialog)
    dialog.show()
    open_repo(qtbot, dialog)
    qtbot.mouseClick(dialog.download_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dialog.bar.value() > 0, timeout=TIMEOUT_MS)
    assert dialog.cancel_button.isVisible() and not dialog.download_button.isEnabled()
    qtbot.mouseClick(dialog.cancel_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "cancelled" in dialog.progress_label.text(), timeout=TIMEOUT_MS)
    assert dialog.download_button.isEnabled() and not dialog.cancel_button.isVisible()


def test_the_downloaded_model_is_chosen_in_the_picker(qtbot, app_driver, tiny_model_dir, server, tiny_gguf):
    window = app_driver.open(tiny_model_dir)
    window.settings_panel.picker.hub_action.trigger()  # Open… ▸ From the Hugging Face Hub… (File ▸ Get models…)
    dialog = window.hub_dialog
    open_repo(qtbot, dialog)
    with qtbot.waitSignal(dialog.downloaded, timeout=TIMEOUT_MS) as finished:
        qtbot.mouseClick(dialog.download_button, Qt.MouseButton.LeftButton)
    picker = window.settings_panel.picker
    assert picker.combo.currentData() == finished.args[0]
    assert window.model_dir == finished.args[0]
    # the window reads it as any model: its forecast is the downloaded file's
    qtbot.waitUntil(lambda: window.forecast is not None and str(window.forecast.info.model_dir) == finished.args[0],
                    timeout=TIMEOUT_MS)
    assert window.forecast.info.num_layers == 2
    dialog.close()


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_closing_the_dialog_mid_download_stops_it_quietly(qtbot, server, tmp_path):
    import threading

    server.slow["Tiny-Q8_0.gguf"] = 0.05
    dialog = HubDialog(request=PlanRequest(512), budgets=lambda: given_budgets([], 8 * GiB), hub=Hub(server.url))
    dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
    dialog.show()
    open_repo(qtbot, dialog)
    qtbot.mouseClick(dialog.download_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dialog.bar.value() > 0, timeout=TIMEOUT_MS)
    dialog.close()  # deleted: the download thread must end without touching it
    qtbot.waitUntil(lambda: not any(t.name == "hub-download" for t in threading.enumerate()), timeout=TIMEOUT_MS)
    partial = list((tmp_path / "hf-cache").glob("models--acme--Tiny-GGUF/blobs/*.incomplete"))
    assert len(partial) == 1 and partial[0].stat().st_size > 0  # kept for the next download to resume
