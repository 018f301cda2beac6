"""The main window: chat on the left, settings on the right, memory graphs below, a status bar."""

from __future__ import annotations

import gc
import logging
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QByteArray, QEvent, Qt, QTimer
from PySide6.QtWidgets import QLabel, QMainWindow, QMessageBox, QSizePolicy, QSplitter

from stowage.engine.formats.discovery import gguf_models, is_model_dir, remember_app_opened
from stowage.engine.formats.gguf import is_gguf_file
from stowage.engine.planning.report import summary

from . import theme
from .chat_panel import ChatPanel
from .conversation_list import ConversationList
from .forecast import Forecast
from .memory_graph import MemoryGraph
from .memory_stats import MemoryStats
from .menu_bar import build_menus
from .model_catalog import find_models
from .model_watch import ModelWatch
from .model_settings import ModelSettings, load_model_settings, model_defaults, open_settings, save_model_settings
from .remote_chooser import RemoteChooser
from .remote_source import RemoteModel, ServerBook
from .serve_settings import (ServeSettings, load_serve_settings, port_taken, restart_message, save_serve_settings,
                             taken_message)
from .settings_panel import SettingsPanel
from .store import ConversationStore
from .worker import EngineClient

log = logging.getLogger(__name__)

TITLE = "Stowage"
RESTARTING = "Restarting the engine to listen as asked…"  # Serve's note while its change restarts the engine


class MainWindow(QMainWindow):
    def __init__(self, store: ConversationStore | None = None, stats: MemoryStats | None = None, models=None):
        super().__init__()
        self.setWindowTitle(TITLE)
        self.qsettings = open_settings()
        theme.apply(theme.stored(self.qsettings))  # before the widgets: they take their colours from it
        self.store = store or ConversationStore()
        self.stats = stats or MemoryStats()
        self.client = EngineClient(self)
        self.model_dir: str | None = None  # the chosen (inspected) model
        self.remote: RemoteModel | None = None  # or the chosen server's model, once its server confirmed it
        self.loaded_dir: str | None = None
        self.loaded_remote: RemoteModel | None = None
        self.loaded_plan = None
        self._loading_plan = None
        # Serve: what the user asks for, and what the loaded engine was started with (a difference restarts it)
        self.serve_settings: ServeSettings = load_serve_settings(self.qsettings)
        self.loaded_serve: ServeSettings | None = None
        self._loading_serve: ServeSettings | None = None
        # the forecast and settings of the plan loaded last: its plan again for other Serve sequences
        self.loaded_forecast = self._loading_forecast = None
        self._serve_timer = QTimer(self)  # one restart after a burst of changes (arrows on the port box)
        self._serve_timer.setSingleShot(True)
        self._serve_timer.setInterval(400)
        self._serve_timer.timeout.connect(self._restart_for_serve)
        self._serve_restarting = False  # the engine's unload is the start of Serve's restart, not the user's
        self.forecast: Forecast | None = None
        self.error_box: QMessageBox | None = None
        self.about_box: QMessageBox | None = None
        self.history_box: QMessageBox | None = None  # the store's warning at start; model errors do not replace it
        self._closed = False
        self._unsaved = None  # (model_dir, ModelSettings) waiting for the save timer
        self._save_timer = QTimer(self)
        self._save_timer.setSingleShot(True)
        self._save_timer.setInterval(1000)
        self._save_timer.timeout.connect(self._save_settings)

        self.conversations = ConversationList(self.store)
        self.chat = ChatPanel(self.store, self.client)
        catalog = find_models() if models is None else models
        self.settings_panel = SettingsPanel(catalog)
        # The places models are kept are watched when the list is the catalog's (tests pass theirs).
        self.model_watch = ModelWatch(find_models, self) if models is None else None
        if self.model_watch is not None:
            self.model_watch.seen(catalog)
            self.model_watch.found.connect(self.settings_panel.picker.update_models)
        self.graph = MemoryGraph(self.stats)

        self.left = QSplitter(Qt.Orientation.Horizontal)
        self.left.addWidget(self.conversations)
        self.left.addWidget(self.chat)
        self.left.setStretchFactor(1, 1)
        self.left.setSizes([180, 620])
        self.main = QSplitter(Qt.Orientation.Horizontal)
        self.main.addWidget(self.left)
        self.main.addWidget(self.settings_panel)
        self.main.setStretchFactor(0, 1)
        self.main.setCollapsible(1, False)  # the settings are never squeezed out of sight
        self.main.setSizes([900, 380])  # at 1024 pixels the chat still gets about half
        self.vertical = QSplitter(Qt.Orientation.Vertical)
        self.vertical.addWidget(self.main)
        self.vertical.addWidget(self.graph)
        self.vertical.setStretchFactor(0, 1)
        self.vertical.setSizes([600, 170])
        self.setCentralWidget(self.vertical)

        self.device_label = QLabel(self.stats.device_summary())
        self.model_label = QLabel("No model loaded")
        self.plan_label = QLabel()
        # A long device or plan line must not set the window's minimum width: it is cut, the tooltip has it all.
        self.device_label.setMinimumWidth(80)
        self.plan_label.setMinimumWidth(80)
        self.plan_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.device_label.setToolTip(self.device_label.text())
        status = self.statusBar()
        status.addWidget(self.device_label)
        status.addWidget(_separator())
        status.addWidget(self.model_label)
        status.addWidget(_separator())
        status.addWidget(self.plan_label, 1)

        self.conversations.selected.connect(self.chat.show_conversation)
        self.conversations.deleted.connect(self.chat.conversation_deleted)
        self.chat.conversation_created.connect(self.conversations.refresh)
        self.chat.conversation_renamed.connect(self.conversations.refresh)
        panel = self.settings_panel
        panel.model_chosen.connect(self.choose_model)
        self.remotes = RemoteChooser(panel.picker, ServerBook(self.qsettings), self)
        self.remotes.ready.connect(self._remote_chosen)
        self.remotes.failed.connect(self._remote_failed)
        panel.picker.server_requested.connect(self.add_server_dialog)
        panel.picker.forget_requested.connect(self._server_forgotten)
        panel.serve.changed.connect(self._serve_changed)
        panel.settings_changed.connect(self._settings_changed)
        panel.plan_changed.connect(self._plan_changed)
        panel.load_requested.connect(self.load)
        panel.unload_requested.connect(self.client.unload)
        panel.cancel_requested.connect(self.client.cancel_load)
        worker = self.client.worker
        worker.inspected.connect(self._inspected)
        worker.inspect_failed.connect(self._inspect_failed)
        worker.load_progress.connect(panel.show_loading)
        worker.loaded.connect(self._loaded)
        worker.load_failed.connect(self._load_failed)
        worker.load_cancelled.connect(self._load_cancelled)
        worker.unloaded.connect(self._unloaded)
        worker.engine_started.connect(self.stats.follow)  # the graphs follow the engine where it runs
        worker.load_started.connect(self._load_started)
        worker.engine_crashed.connect(self._engine_crashed)
        worker.model_unloaded.connect(self._model_unloaded)
        worker.remote_loaded.connect(self._remote_loaded)
        worker.remote_health.connect(self._remote_health)
        worker.serve_refused.connect(lambda message: panel.serve.set_endpoint(None, message))

        build_menus(self)
        self.setAcceptDrops(True)  # a model folder or .gguf file dropped anywhere on the window opens it
        self.resize(1280, 800)
        self._restore_layout()
        rows = self.store.conversations()
        if rows:
            self.conversations.select(rows[0].id)
        else:
            self.chat.show_conversation(None)
        for folder in self._remembered_folders():
            if Path(folder).exists():
                panel.picker.add_folder(folder)
        self._share_opened(self._remembered_folders())  # settings kept by an older version, shared from now on
        panel.serve.set_settings(self.serve_settings)
        panel.set_num_seqs(self.serve_settings.plan_seqs)
        # First run: the demo model (first in the list); later runs: the model used last.
        last = self.qsettings.value("last_model", "")
        first = panel.model_combo.itemData(1) if panel.model_combo.count() > 1 else None
        first = first if isinstance(first, str) else None
        start_model = last if last and Path(last).exists() else first
        last_remote = next((m for m in self.remotes.book.models() if m.ref == last), None)
        if last_remote is not None:  # asked on the probe's thread, as when chosen
            panel.picker.select_remote(last_remote)
            QTimer.singleShot(0, lambda: self.remotes.choose(last_remote))
        elif start_model:
            panel.select_model_dir(start_model)
            QTimer.singleShot(0, lambda: self.choose_model(start_model))
        if self.store.warning:
            # Once the window is up (a dialog before it would float alone); the app runs on behind it.
            QTimer.singleShot(0, lambda: self._show_history_warning(self.store.warning))
        # torch, Qt and pyqtgraph leave hundreds of thousands of long-lived objects; a full garbage collection
        # walks them all while holding the GIL, in whichever thread happens to allocate, and froze the window
        # during loads (docs/benchmarks.md). Frozen, they are never walked again.
        gc.collect()
        gc.freeze()

    # -- choosing and inspecting a model ----------------------------------------------------------
    def choose_model(self, model_dir: str) -> None:
        folder = Path(model_dir)
        if folder.is_dir() and not is_model_dir(folder) and len(gguf_models(folder)) > 1:
            # a folder remembered before it held several GGUFs: each is listed and one chosen, never refused
            self.settings_panel.picker.open_path(model_dir)
            return
        self.model_dir, self.remote = model_dir, None
        self.remotes.forget()
        self._show_graphs()
        self.settings_panel.picker.say(f"Reading {Path(model_dir).name}…")
        self.client.inspect(model_dir)

    def _inspected(self, model_dir: str, info, budgets) -> None:
        if model_dir != self.model_dir or self._closed:
            return  # the user already chose another (or closed the window: its store is closed)
        self._save_settings()  # the previous model's last changes, before its settings leave the panel
        self.forecast = Forecast(info, budgets)
        defaults = model_defaults(Path(model_dir))
        settings = load_model_settings(self.qsettings, Path(model_dir), defaults)
        self.chat.set_settings(settings)
        self.settings_panel.set_model(self.forecast, settings, defaults)
        self.qsettings.setValue("last_model", model_dir)
        if model_dir not in self.settings_panel.picker.catalog_dirs:
            self._remember_folder(model_dir, True)

    def _inspect_failed(self, model_dir: str, message: str) -> None:
        if model_dir != self.model_dir:
            return
        self.forecast = None
        self.settings_panel.show_model_error(message)
        self.settings_panel.picker.forget_folder(model_dir)
        self._remember_folder(model_dir, False)
        self.show_error(f"{Path(model_dir).name} cannot be used",
                        f"{message}\n\nChoose another model, or download this one again.")

    def _remembered_folders(self) -> list[str]:
        """Model folders and .gguf files opened with Open… that worked, offered again at the next start."""
        value = self.qsettings.value("model_folders", [])
        return [value] if isinstance(value, str) else list(value or [])

    def _remember_folder(self, model_dir: str, keep: bool) -> None:
        folders = [f for f in self._remembered_folders() if f != model_dir] + ([model_dir] if keep else [])
        self.qsettings.setValue("model_folders", folders)
        self._share_opened(folders)

    @staticmethod
    def _share_opened(folders: list[str]) -> None:
        """Where `stowage list` finds what was opened here (a JSON file of the data folder, on every platform)."""
        try:
            remember_app_opened(folders)
        except OSError as e:  # a read-only data folder: the CLI lists less, the app goes on
            log.warning("cannot write the opened models for `stowage list`: %s", e)

    # -- remote servers --------------------------------------------------------------------------
    def add_server_dialog(self) -> None:
        self.remotes.open_dialog(self)

    def _remote_chosen(self, model: RemoteModel) -> None:
        """Its server confirmed the chosen model: its settings, no forecast, no graphs."""
        self._save_settings()
        self.model_dir, self.remote, self.forecast = None, model, None
        self._show_graphs()
        settings = load_model_settings(self.qsettings, model, ModelSettings())
        self.chat.set_settings(settings)
        self.settings_panel.set_remote(model, settings)
        self.qsettings.setValue("last_model", model.ref)

    def _remote_failed(self, message: str) -> None:
        self.remote = None
        self.settings_panel.show_model_error(message)

    def _server_forgotten(self, base_url: str) -> None:
        self.model_dir = self.remote = None
        self._show_graphs()
        self.settings_panel.show_model_error(f"{base_url} is forgotten. Choose a model, or add a server with "
                                             "Server….", error=False)
        if self.loaded_remote is not None and self.loaded_remote.base_url == base_url:
            self.client.unload()

    def _show_graphs(self) -> None:
        """This machine's memory graphs say nothing about a server's model: hidden while one is chosen."""
        self.graph.setVisible(self.remote is None and self.show_graphs_action.isChecked())

    def _settings_changed(self, settings) -> None:
        self.chat.set_settings(settings)
        target = self.remote or (Path(self.model_dir) if self.model_dir else None)
        if target is not None:
            self._unsaved = (target, settings)
            self._save_timer.start()  # writing the INI file is slow for a slider's pace: once after a burst

    def _save_settings(self) -> None:
        if self._unsaved is not None:
            save_model_settings(self.qsettings, *self._unsaved)
            self._unsaved = None

    def _plan_changed(self, plan) -> None:
        if self.loaded_dir is not None:
            # Loading fixed the placement: the status bar tells what is loaded, and the panel what waits.
            self._show_pending(plan)
            return
        if plan is None:
            self.plan_label.setText("")
        elif plan.fits:
            self.plan_label.setText(summary(plan))
        else:
            self.plan_label.setText(self.settings_panel.explain(plan))
        self.plan_label.setToolTip(self.plan_label.text())

    def _show_pending(self, plan) -> None:
        """Context, layers and KV dtype apply at the next Load; say so while they differ from what is loaded."""
        loaded = f"{Path(self.loaded_dir).name} stays loaded with {summary(self.loaded_plan)}"
        if self.remote is not None:
            self.settings_panel.show_pending(f"{loaded}: press Connect to use {self.remote.model_id} instead.")
        elif self.model_dir != self.loaded_dir:
            self.settings_panel.show_pending(f"{loaded}: press Load to load {Path(self.model_dir).name} instead.")
        elif plan is not None and summary(plan) != summary(self.loaded_plan):
            self.settings_panel.show_pending(f"Changed since Load, applied at the next Load: {loaded} until then.")
        else:
            self.settings_panel.show_pending("")

    # -- loading ---------------------------------------------------------------------------------
    def load(self) -> None:
        if self.remote is not None:
            self.settings_panel.show_loading(0.0, f"Connecting to {self.remote.host}")
            self.client.connect_remote(self.remote, self.remotes.key_for(self.remote))
            return
        plan = self.settings_panel.plan
        if plan is None or not plan.fits or self.model_dir is None:
            return
        self._loading_forecast = (self.forecast, self.settings_panel.settings)
        self._start_load(self.model_dir, plan, "Starting")

    def _start_load(self, model_dir: str, plan, message: str) -> None:
        self._loading_plan, self._loading_serve = plan, self.serve_settings
        self.settings_panel.show_loading(0.0, message)
        self.client.load(model_dir, plan, threads=self.settings_panel.settings.cpu_threads, serve=self.serve_settings)

    def _load_started(self, pid: int, base_bytes: int) -> None:
        """The graphs measure the process that loads (the engine's child) and predict it from here on: what it held
        before the model plus the plan's RAM."""
        self.stats.follow(pid)
        if self._loading_plan is not None:
            self.graph.expect(self._loading_plan, base_bytes)

    def _loaded(self, model_dir: str, seconds: float) -> None:
        self.loaded_dir, self.loaded_plan = model_dir, self._loading_plan
        self.loaded_serve, self.loaded_forecast = self._loading_serve, self._loading_forecast
        if self.client.worker.serving is None and self.loaded_serve.on:  # its port was taken: started privately
            self.loaded_serve = replace(self.loaded_serve, on=False)
        name = Path(model_dir).name
        self.setWindowTitle(f"{TITLE} — {name}")
        self.model_label.setText(f"{name} loaded")
        took = f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1000:.0f} ms"
        # The worker's tokenizer formats the chats (in either engine mode); it is set before `loaded` is sent.
        template = getattr(self.client.worker.tokenizer, "template_source", "")
        self.settings_panel.show_loaded(f"{name} loaded in {took}", template)
        # after a Serve restart the panel may still show settings that are not loaded: said until the next Load
        self._show_pending(self.settings_panel.plan)
        self.plan_label.setText(summary(self.loaded_plan))
        self.plan_label.setToolTip(self.plan_label.text())
        self.chat.set_model_loaded(self.loaded_plan.context_tokens, name)
        self.chat.input.setFocus()
        self.settings_panel.serve.set_endpoint(self.client.worker.endpoint, "" if self.client.worker.use_process else
                                               "The engine runs inside the app (STOWAGE_ENGINE_PROCESS=0): it has "
                                               "no server to share.")
        self._serve_changed(self.serve_settings)  # changed while it loaded: started again as asked now

    def _remote_loaded(self, model: RemoteModel, seconds: float) -> None:
        self.loaded_remote = model
        self.setWindowTitle(f"{TITLE} — {model.model_id}")
        self.model_label.setText(f"{model.model_id} on {model.host}")
        self.settings_panel.show_loaded(f"Connected to {model.model_id} on {model.base_url} in {seconds * 1000:.0f} "
                                        "ms", "the server's (it formats the chats)")
        self.plan_label.setText(f"{model.context_tokens:,}-token context on {model.host}")
        self.plan_label.setToolTip(self.plan_label.text())
        self.chat.set_model_loaded(model.context_tokens, model.model_id)
        self.chat.input.setFocus()
        self.settings_panel.serve.set_endpoint(None, f"{model.model_id} is served by {model.host} already.")

    def _remote_health(self, answering: bool, why: str) -> None:
        """The connected server stopped answering (or answers again): no "Connected" in green while it is gone."""
        model = self.loaded_remote
        if model is None:
            return
        if answering:
            self.settings_panel.loading.say(f"Connected to {model.model_id} on {model.base_url}: it answers again.")
            self.model_label.setText(f"{model.model_id} on {model.host}")
        else:
            self.settings_panel.loading.say(f"{model.host} does not answer: {why}. Messages fail until it is back "
                                            "(checked every few seconds).", error=True)
            self.model_label.setText(f"{model.model_id} on {model.host}: not answering")

    # -- Serve -----------------------------------------------------------------------------------
    def _serve_changed(self, settings: ServeSettings) -> None:
        """Serve on or off, its port, address, sequences or key changed: kept, forecast, and the loaded engine
        started again to listen as asked (a key that was given out stops working with it)."""
        if settings != self.serve_settings:
            save_serve_settings(self.qsettings, settings)
            self.serve_settings = settings
            self.settings_panel.set_num_seqs(settings.plan_seqs)
        if self._serve_restart_needed():
            self.settings_panel.serve.set_endpoint(None, RESTARTING)
            self._serve_timer.start()
        elif self.loaded_dir is not None and self.client.worker.use_process:
            self._serve_timer.stop()  # a restart asked a moment ago is not needed any more (Serve ticked and unticked)
            self.settings_panel.serve.set_endpoint(self.client.worker.endpoint)

    def _serve_restart_needed(self) -> bool:
        return (self.loaded_dir is not None and self.client.worker.use_process
                and self.loaded_serve.listening() != self.serve_settings.listening())

    def _restart_for_serve(self) -> None:
        """The same model and plan in a new engine listening as Serve says; other sequences are planned again."""
        if not self._serve_restart_needed():
            return
        serve, plan = self.serve_settings, self.loaded_plan
        ours = self.loaded_serve.on and self.loaded_serve.port == serve.port  # the engine's own port: freed first
        if not ours and port_taken(serve):  # the engine serves on as it was: a restart would lose the model
            self.settings_panel.serve.set_endpoint(None, taken_message(serve))
            return
        if plan.num_seqs != serve.plan_seqs:
            forecast, settings = self.loaded_forecast
            plan = forecast.plan(settings, num_seqs=serve.plan_seqs)
            if not plan.fits:  # the engine serves on as it was
                self.settings_panel.serve.set_endpoint(
                    None, f"{serve.plan_seqs} sequences do not fit: {plan.error} Lower Sequences or the context "
                          "(then Load).")
                return
        self._serve_restarting = True
        self._start_load(self.loaded_dir, plan, restart_message(self.loaded_serve, serve))

    def _load_failed(self, message: str) -> None:
        self.graph.set_prediction(None)
        self.settings_panel.show_unloaded(message, error=True)
        self.show_error("Loading failed", message)

    def _engine_crashed(self, message: str) -> None:
        """The engine process died (the chat keeps the partial reply): say so, and offer to start it again on the
        same model and plan."""
        if self.loaded_dir is None or self._closed:
            return
        model_dir, plan = self.loaded_dir, self.loaded_plan
        self.show_error("The engine stopped", message)
        restart = self.error_box.addButton("Restart engine", QMessageBox.ButtonRole.AcceptRole)
        restart.clicked.connect(lambda: self._restart(model_dir, plan))

    def _model_unloaded(self, message: str) -> None:
        """The engine unloaded its model by itself (its weights file changed): say why; Load loads it again."""
        if self.loaded_dir is not None and not self._closed:
            self.show_error("The model was unloaded", message)

    def _restart(self, model_dir: str, plan) -> None:
        if self.loaded_dir is not None:
            return  # loaded again meanwhile
        self._start_load(model_dir, plan, "Restarting the engine")

    def _load_cancelled(self) -> None:
        self.graph.set_prediction(None)
        self.settings_panel.show_unloaded("Loading cancelled; nothing is held.")

    def _unloaded(self) -> None:
        self.stats.follow(None)
        self.graph.set_prediction(None)
        self.loaded_dir = self.loaded_plan = self.loaded_remote = self.loaded_serve = None
        self.settings_panel.serve.set_endpoint(None, RESTARTING
                                               if self._serve_restarting else "Load a model to serve it.")
        self._serve_restarting = False
        self.setWindowTitle(TITLE)
        self.model_label.setText("No model loaded")
        self.chat.set_model_loaded(0)
        self.settings_panel.show_unloaded("Unloaded; the memory is free again.")
        self.settings_panel.show_pending("")
        self._plan_changed(self.settings_panel.plan)

    # -- drag and drop, the window coming back -----------------------------------------------------
    def dragEnterEvent(self, event) -> None:
        if _dropped_models(event.mimeData()):
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:
        """Every model dropped joins the list; the first is chosen."""
        dropped = _dropped_models(event.mimeData())
        if not dropped:
            return
        event.acceptProposedAction()
        picker = self.settings_panel.picker
        for path in dropped[1:]:
            picker.add_folder(path)
        picker.open_path(dropped[0])

    def showEvent(self, event) -> None:
        # A drag reaches the window's QWindow before the child under the cursor: a text box there (the message, the
        # search, a system prompt) would paste a dropped model's path instead of passing it on to the window.
        self.windowHandle().installEventFilter(self)  # installed once: Qt moves an installed filter, never doubles it
        super().showEvent(event)

    def eventFilter(self, watched, event) -> bool:
        if (event.type() in _MODEL_DROP_EVENTS and watched is self.windowHandle()
                and _dropped_models(event.mimeData())):
            if event.type() == QEvent.Type.Drop:
                self.dropEvent(event)
            else:
                event.acceptProposedAction()
            return True
        return super().eventFilter(watched, event)

    def changeEvent(self, event) -> None:
        # Back from a browser or a file manager: a model may have been downloaded or copied meanwhile.
        if event.type() == QEvent.Type.ActivationChange and self.isActiveWindow() and self.model_watch is not None:
            self.model_watch.refresh_soon()
        super().changeEvent(event)

    # -- errors ----------------------------------------------------------------------------------
    def show_error(self, title: str, message: str) -> None:
        """A dialog that does not block the event loop: the engine thread keeps reporting behind it."""
        if self.error_box is not None:
            self.error_box.close()
        self.error_box = self._open_warning(title, message)

    def _show_history_warning(self, message: str) -> None:
        if not self._closed:
            self.history_box = self._open_warning("Conversation history", message)

    def _open_warning(self, title: str, message: str) -> QMessageBox:
        box = QMessageBox(QMessageBox.Icon.Warning, title, f"<b>{title}</b>", QMessageBox.StandardButton.Ok, self)
        box.setInformativeText(message)
        box.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        box.open()
        return box

    # -- layout memory ---------------------------------------------------------------------------
    def _restore_layout(self) -> None:
        s = self.qsettings
        for key, restore in (("window/geometry", self.restoreGeometry), ("window/main", self.main.restoreState),
                             ("window/left", self.left.restoreState), ("window/vertical", self.vertical.restoreState)):
            value = s.value(key)
            if isinstance(value, QByteArray) and not value.isEmpty():
                restore(value)

    def closeEvent(self, event) -> None:
        if self._closed:  # a second close (tests, or the OS) has nothing left to free
            return super().closeEvent(event)
        self._closed = True
        self._save_settings()
        s = self.qsettings
        s.setValue("window/geometry", self.saveGeometry())
        s.setValue("window/main", self.main.saveState())
        s.setValue("window/left", self.left.saveState())
        s.setValue("window/vertical", self.vertical.saveState())
        s.sync()
        self.graph.timer.stop()
        self.remotes.shutdown()
        self.client.shutdown()
        self.store.close()
        gc.unfreeze()  # let exit clean up normally (extension modules report leaks otherwise)
        super().closeEvent(event)


_MODEL_DROP_EVENTS = (QEvent.Type.DragEnter, QEvent.Type.DragMove, QEvent.Type.Drop)


def _dropped_models(mime) -> list[str]:
    """The dropped local folders and GGUF files (a model folder, a folder of .gguf files, or .gguf files)."""
    if not mime.hasUrls():
        return []
    found = []
    for url in mime.urls():
        path = Path(url.toLocalFile()) if url.isLocalFile() else None
        if path is not None and (path.is_dir() or (path.is_file() and is_gguf_file(path))):
            found.append(str(path))
    return found


def _separator() -> QLabel:
    label = QLabel("|")
    theme.tint(label, "muted")
    return label
