"""File ▸ Get models…: search the Hugging Face Hub, see whether each file of a repository fits before downloading it
(engine/hub's verdict from the file's header, for the context, KV dtype and budgets of the settings panel), download
one with progress and cancel; the finished model is opened in the model picker.

Everything that touches the network runs on a worker thread (one for asking, one for a download); results come
back through queued signals, and only GUI-thread slots touch the widgets."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import (QAbstractItemView, QDialog, QDialogButtonBox, QHBoxLayout, QHeaderView, QLabel,
                               QLineEdit, QListWidget, QListWidgetItem, QProgressBar, QPushButton, QSpinBox,
                               QTableWidget, QTableWidgetItem, QVBoxLayout)

from stowage.engine.defaults import DEFAULT_CONTEXT
from stowage.engine.errors import DownloadCancelled, HubError, StowageError
from stowage.engine.planning.budgets import Budgets
from stowage.engine.planning.plan import PlanRequest
from stowage.engine.units import format_bytes, format_duration

COLUMNS = ("File", "Quantization", "Size", "Fit on this machine")
MAX_CONTEXT = 10_000_000


class _Relay(QObject):
    """Signals a worker thread emits; made on the GUI thread, so its slots run there (queued connections)."""

    searched = Signal(int, object)  # generation, [RepoHit]
    listed = Signal(int, object)  # generation, RepoFiles
    judged = Signal(int, int, object)  # generation, row, Verdict
    failed = Signal(int, str)  # generation, message
    progress = Signal(object)  # DownloadProgress
    finished = Signal(str)  # the downloaded model's path
    stopped = Signal(str)  # a download failed or was cancelled: why


class HubDialog(QDialog):
    """Search, a repository's files with their verdicts, and a download. `downloaded(path)` when one finishes."""

    downloaded = Signal(str)

    def __init__(self, parent=None, *, request: PlanRequest | None = None,
                 budgets: Callable[[], Budgets] | None = None, hub=None):
        super().__init__(parent)
        self.setWindowTitle("Get models from the Hugging Face Hub")
        self.resize(1000, 600)
        from stowage.engine.hub.client import Hub
        from stowage.engine.hub.header import HeaderReader, header_cache_dir
        from stowage.engine.planning.budgets import detect_budgets

        self.hub = hub or Hub()
        self.reader = HeaderReader(self.hub, header_cache_dir())
        self.request = request or PlanRequest(DEFAULT_CONTEXT)
        self._budgets = budgets or detect_budgets
        self.files = None  # the RepoFiles on screen
        self.verdicts: dict[int, object] = {}
        self._generation = 0
        self._asking = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hub")
        self._cancel: threading.Event | None = None
        # no parent: a worker still running when the dialog is closed (and deleted) emits into a live object, whose
        # connections to the dialog's slots went with the dialog
        self._relay = _Relay()
        self._relay.searched.connect(self._show_hits)
        self._relay.listed.connect(self._show_files)
        self._relay.judged.connect(self._show_verdict)
        self._relay.failed.connect(self._show_failure)
        self._relay.progress.connect(self._show_progress)
        self._relay.finished.connect(self._download_finished)
        self._relay.stopped.connect(self._download_stopped)
        self._build()

    def _build(self) -> None:
        self.search_box = QLineEdit()
        self.search_box.setPlaceholderText("Search models, e.g. qwen3 gguf")
        self.search_box.returnPressed.connect(self.search)
        self.search_button = QPushButton("Search")
        self.search_button.clicked.connect(self.search)
        self.results = QListWidget()
        self.results.currentItemChanged.connect(lambda item, _: item is not None and self.open_repo(item.data(
            Qt.ItemDataRole.UserRole)))
        self.context = QSpinBox()
        self.context.setRange(1, MAX_CONTEXT)
        self.context.setGroupSeparatorShown(True)
        self.context.setValue(self.request.context_tokens)
        self.context.setSuffix(" tokens")
        self.context.editingFinished.connect(self._context_changed)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        for column in range(3):
            self.table.horizontalHeader().setSectionResizeMode(column, QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setSectionResizeMode(3, QHeaderView.ResizeMode.Stretch)
        self.table.verticalHeader().setVisible(False)
        self.table.setWordWrap(True)
        self.table.itemSelectionChanged.connect(self._selection_changed)
        self.note = QLabel()
        self.note.setWordWrap(True)
        self.note.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.bar = QProgressBar()
        self.bar.setVisible(False)
        self.progress_label = QLabel()
        self.download_button = QPushButton("Download")
        self.download_button.setEnabled(False)
        self.download_button.clicked.connect(self.download)
        self.cancel_button = QPushButton("Cancel download")
        self.cancel_button.setVisible(False)
        self.cancel_button.clicked.connect(self.cancel)
        close = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        close.rejected.connect(self.reject)

        search_row = QHBoxLayout()
        search_row.addWidget(self.search_box, 1)
        search_row.addWidget(self.search_button)
        context_row = QHBoxLayout()
        context_row.addWidget(QLabel("Fit verdicts for a context of"))
        context_row.addWidget(self.context)
        context_row.addStretch(1)
        download_row = QHBoxLayout()
        download_row.addWidget(self.bar, 1)
        download_row.addWidget(self.cancel_button)
        download_row.addWidget(self.download_button)
        layout = QVBoxLayout(self)
        layout.addLayout(search_row)
        layout.addWidget(self.results, 1)
        layout.addLayout(context_row)
        layout.addWidget(self.table, 2)
        layout.addWidget(self.note)
        layout.addWidget(self.progress_label)
        layout.addLayout(download_row)
        layout.addWidget(close)

    # -- asking (one worker thread; an answer to an older question is dropped) -------------------------

    def _ask(self, work) -> None:
        self._generation += 1
        generation = self._generation

        def run():
            try:
                work(generation)
            except StowageError as e:
                self._relay.failed.emit(generation, str(e))
            except Exception as e:  # noqa: BLE001 - the dialog says it, the app goes on
                self._relay.failed.emit(generation, f"{type(e).__name__}: {e}")

        self._asking.submit(run)

    def search(self) -> None:
        text = self.search_box.text().strip()
        if not text:
            return
        self.results.clear()
        self._say(f"Searching for {text!r}…")
        self._ask(lambda g: self._relay.searched.emit(g, self.hub.search(text)))

    def open_repo(self, repo: str) -> None:
        self.table.setRowCount(0)
        self.files, self.verdicts = None, {}
        self.download_button.setEnabled(False)
        self._say(f"Reading the files of {repo}…")
        request = self.request.with_context(self.context.value())
        self._ask(lambda g: self._list_and_judge(g, repo, request))

    def _list_and_judge(self, generation: int, repo: str, request: PlanRequest) -> None:
        from stowage.engine.hub.verdict import Verdict, verdict

        files = self.hub.files(repo)
        self._relay.listed.emit(generation, files)
        budgets = self._budgets()
        for row, model in enumerate(files.models):
            if generation != self._generation:
                return
            try:
                judged = verdict(self.reader, model, request, budgets)
            except HubError as e:  # a gated file's header: its row says how to get access
                judged = Verdict(model, None, str(e))
            self._relay.judged.emit(generation, row, judged)

    def _context_changed(self) -> None:
        if self.files is not None and self.context.value() != self.request.context_tokens:
            self.request = self.request.with_context(self.context.value())
            self.open_repo(self.files.repo)

    # -- answers (GUI thread) ----------------------------------------------------------------------

    def _show_hits(self, generation: int, hits) -> None:
        if generation != self._generation:
            return
        for hit in hits:
            label = f"{hit.repo}   {', '.join(hit.formats)}" + (f", {hit.architecture}" if hit.architecture else "")
            label += f"   {hit.downloads:,} downloads" + ("   (gated)" if hit.gated else "")
            item = QListWidgetItem(label)
            item.setData(Qt.ItemDataRole.UserRole, hit.repo)
            self.results.addItem(item)
        self._say(f"{len(hits)} repositories Stowage can run." if hits else
                  "No repository with GGUF or safetensors weights Stowage runs matches; try other words.")

    def _show_files(self, generation: int, files) -> None:
        if generation != self._generation:
            return
        self.files = files
        self.table.setRowCount(len(files.models))
        for row, model in enumerate(files.models):
            for column, text in enumerate((model.name, model.quant or model.format, format_bytes(model.size_bytes),
                                           "reading its header…")):
                self.table.setItem(row, column, QTableWidgetItem(text))
        self._say(files.gated_note or (f"{files.repo}: {len(files.models)} models." if files.models else
                                       f"{files.repo} has no GGUF or safetensors model Stowage can run."))

    def _show_verdict(self, generation: int, row: int, verdict) -> None:
        if generation != self._generation or row >= self.table.rowCount():
            return
        self.verdicts[row] = verdict
        item = QTableWidgetItem(verdict.text)
        item.setToolTip(verdict.text)
        self.table.setItem(row, 3, item)
        self.table.resizeRowToContents(row)
        self._selection_changed()

    def _show_failure(self, generation: int, message: str) -> None:
        if generation == self._generation:
            self._say(message, error=True)

    # -- downloading -------------------------------------------------------------------------------

    def selected_row(self) -> int | None:
        rows = {index.row() for index in self.table.selectedIndexes()}
        return rows.pop() if len(rows) == 1 else None

    def _selection_changed(self) -> None:
        self.download_button.setEnabled(self.files is not None and self.selected_row() is not None
                                        and self._cancel is None)

    def download(self) -> None:
        from stowage.engine.hub.download import pull

        row = self.selected_row()
        if self.files is None or row is None or self._cancel is not None:
            return
        model = self.files.models[row]
        cancel = self._cancel = threading.Event()
        self.bar.setRange(0, 1000)
        self.bar.setValue(0)
        self.bar.setVisible(True)
        self.cancel_button.setVisible(True)
        self.download_button.setEnabled(False)
        self.progress_label.setText(f"Downloading {model.name} ({format_bytes(model.size_bytes)})…")

        def run():
            try:
                path = pull(self.hub, model, progress=self._relay.progress.emit, cancel=cancel)
            except DownloadCancelled:
                self._relay.stopped.emit("Download cancelled; downloading it again resumes where it stopped.")
            except StowageError as e:
                self._relay.stopped.emit(str(e))
            except Exception as e:  # noqa: BLE001
                self._relay.stopped.emit(f"{type(e).__name__}: {e}")
            else:
                self._relay.finished.emit(str(path))

        threading.Thread(target=run, name="hub-download", daemon=True).start()

    def cancel(self) -> None:
        if self._cancel is not None:
            self._cancel.set()
            self.progress_label.setText("Cancelling…")

    def _show_progress(self, p) -> None:
        self.bar.setValue(int(1000 * p.done_bytes / p.total_bytes) if p.total_bytes else 1000)
        left = f", about {format_duration(p.seconds_left)} left" if p.seconds_left is not None else ""
        self.progress_label.setText(f"{p.file}: {format_bytes(p.done_bytes)} of {format_bytes(p.total_bytes)}, "
                                    f"{format_bytes(int(p.rate_bytes_per_s))}/s{left}")

    def _download_finished(self, path: str) -> None:
        self._end_download()
        self.bar.setValue(1000)
        self.progress_label.setText(f"Downloaded: {path}. It is chosen in the model list.")
        self.downloaded.emit(path)

    def _download_stopped(self, message: str) -> None:
        self._end_download()
        self.progress_label.setText(message)

    def _end_download(self) -> None:
        self._cancel = None
        self.cancel_button.setVisible(False)
        self._selection_changed()

    def _say(self, text: str, error: bool = False) -> None:
        self.note.setText(text)
        self.note.setProperty("error", error)

    def done(self, result: int) -> None:
        """Closing cancels a running download (what was fetched stays, for the next one to resume)."""
        self.cancel()
        self._generation += 1
        self._asking.shutdown(wait=False, cancel_futures=True)
        super().done(result)


def open_hub_dialog(window) -> HubDialog:
    """File ▸ Get models…: the dialog for the window's current settings; a finished model is opened in its picker."""
    forecast, panel = getattr(window, "forecast", None), window.settings_panel
    settings = getattr(panel, "settings", None)
    if forecast is not None and settings is not None:
        request = forecast.request(settings)
        dialog = HubDialog(window, request=request, budgets=lambda: forecast.budgets(settings))
    else:
        dialog = HubDialog(window)
    dialog.downloaded.connect(panel.picker.open_path)
    dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
    dialog.open()
    window.hub_dialog = dialog
    return dialog
