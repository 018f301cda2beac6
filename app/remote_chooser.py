"""Server… and a server's model from the list: the servers are asked off the GUI thread, and `ready` says which
model its server confirmed (with the context the server says now), `failed` why none."""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal

from .model_picker import ModelPicker
from .remote_source import RemoteModel, ServerBook, ServerProbeClient
from .server_dialog import ServerDialog


class RemoteChooser(QObject):
    ready = Signal(object)  # RemoteModel
    failed = Signal(str)  # what went wrong, and what to do

    def __init__(self, picker: ModelPicker, book: ServerBook, parent=None):
        super().__init__(parent)
        self.picker, self.book = picker, book
        self.probe = ServerProbeClient(self)
        self.wanted: RemoteModel | None = None  # the model asked about; None once the user chose a local one
        self._adding: str | None = None  # a server added with Server…, until it answers
        self.dialog: ServerDialog | None = None
        for url, server in book.servers.items():  # as they listed last: no network before the user asks
            picker.set_remote_models(url, server["models"])
        picker.remote_chosen.connect(self.choose)
        picker.forget_requested.connect(self.forget_server)
        self.probe.probe.listed.connect(self._listed)
        self.probe.probe.failed.connect(self._failed)

    def open_dialog(self, parent) -> None:
        """Server…: a dialog that does not block the event loop."""
        self.dialog = ServerDialog(parent)
        self.dialog.chosen.connect(self.add)
        self.dialog.open()

    def add(self, base_url: str, api_key: str | None, remember_key: bool) -> None:
        """Ask `base_url` for its models; they join the list, and the first is chosen."""
        self.book.add(base_url, api_key, remember_key)
        self._adding, self.wanted = base_url, None
        self.picker.say(f"Asking {base_url} for its models…")
        self.probe.list_models(base_url, api_key)

    def choose(self, model: RemoteModel) -> None:
        """Ask the server about `model` first: it may be gone, or its context changed."""
        self.wanted = model
        self.picker.say(f"Asking {model.host} about {model.model_id}…")
        self.probe.list_models(model.base_url, self.book.key_for(model.base_url))

    def forget_server(self, base_url: str) -> None:
        """Forget server: out of the list and the settings, its key with it."""
        self.book.remove(base_url)
        self.picker.set_remote_models(base_url, [])
        self.picker.combo.setCurrentIndex(0)
        if self.wanted is not None and self.wanted.base_url == base_url:
            self.wanted = None

    def forget(self) -> None:
        """The user chose a local model: an answer still on its way changes nothing."""
        self.wanted = self._adding = None

    def key_for(self, model: RemoteModel) -> str | None:
        return self.book.key_for(model.base_url)

    def shutdown(self) -> None:
        self.probe.shutdown()

    def _listed(self, base_url: str, models: list[RemoteModel]) -> None:
        self.book.set_models(base_url, models)
        self.picker.set_remote_models(base_url, models)
        if base_url == self._adding:
            self._adding, self.wanted = None, models[0]
            self.picker.select_remote(models[0])
        if self.wanted is None or self.wanted.base_url != base_url:
            return  # another model was chosen meanwhile
        model = next((m for m in models if m.model_id == self.wanted.model_id), None)
        if model is None:
            self._failed(base_url, f"{base_url} no longer lists {self.wanted.model_id}")
            return
        self.wanted = model
        self.ready.emit(model)

    def _failed(self, base_url: str, message: str) -> None:
        if base_url != self._adding and (self.wanted is None or self.wanted.base_url != base_url):
            return
        self._adding = self.wanted = None
        self.failed.emit(f"{message}\nCheck the address and key with Server…, or choose another model.")
