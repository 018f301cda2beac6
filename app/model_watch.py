"""The model list kept current: models downloaded or copied into the places Stowage looks (its models folder, the
Hugging Face cache, LM Studio's folders) join the picker without a restart.

A QFileSystemWatcher sees a folder's own entries change, not its subfolders', so each place is watched down to the
folders a model appears in (HF: models--*/snapshots/<revision>; LM Studio: publisher/repository); a change, or the
window coming back to the front, finds the models again after a short pause.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QFileSystemWatcher, QObject, QTimer, Signal

from stowage.engine.formats.discovery import Places

from . import paths

SETTLE_MS = 500  # a download or a copy writes many entries: one listing after they settle


def watched_folders(places: Places) -> list[str]:
    """Every folder where a new model would change an entry: each place, and the folders a model is found in."""
    folders: list[Path] = []

    def walk(root: Path | None, depth: int) -> None:
        if root is None or not root.is_dir():
            return
        folders.append(root)
        if depth > 0:
            try:
                children = sorted(p for p in root.iterdir() if p.is_dir())
            except OSError:
                return
            for child in children:
                walk(child, depth - 1)

    walk(places.stowage_models, 1)  # a model folder, or a folder of .gguf files, dropped in
    walk(places.hf_cache, 3)  # models--org--name/snapshots/<revision>
    for root in places.lmstudio:
        walk(root, 2)  # publisher/repository/*.gguf
    return [str(f) for f in folders]


class ModelWatch(QObject):
    """`found(list[ModelEntry])` when the models `find()` lists are not those it listed last."""

    found = Signal(object)

    def __init__(self, find: Callable[[], list], parent=None, *, places: Callable[[], Places] | None = None):
        super().__init__(parent)
        self.find = find
        self.places = places or (lambda: Places.default(paths.models_dir()))
        self.last: list | None = None
        self.watcher = QFileSystemWatcher(self)
        self.timer = QTimer(self)
        self.timer.setSingleShot(True)
        self.timer.setInterval(SETTLE_MS)
        self.timer.timeout.connect(self.refresh)
        self.watcher.directoryChanged.connect(lambda _: self.timer.start())
        self._watch()

    def refresh_soon(self) -> None:
        self.timer.start()

    def refresh(self) -> None:
        models = self.find()
        self._watch()  # new folders (a repository being downloaded) are watched from now on
        if models != self.last:
            changed = self.last is not None
            self.last = models
            if changed:
                self.found.emit(models)

    def seen(self, models: list) -> None:
        """The list the window started with: only a difference from it is news."""
        self.last = list(models)

    def _watch(self) -> None:
        wanted = set(watched_folders(self.places()))
        current = set(self.watcher.directories())
        if current - wanted:
            self.watcher.removePaths(sorted(current - wanted))
        if wanted - current:
            self.watcher.addPaths(sorted(wanted - current))
