"""Model folders found where people keep them: the bundled demo, the Stowage models folder, the HF cache."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import paths


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path
    source: str  # "demo" | "stowage" | "huggingface" | "folder"

    @property
    def label(self) -> str:
        return {"demo": f"{self.name} (demo)", "huggingface": f"{self.name} (HF cache)"}.get(self.source, self.name)


def is_model_dir(path: Path) -> bool:
    """A folder Stowage could load: config.json and safetensors weights (a pickle is never offered)."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def find_models(hf_cache: Path | None = None, stowage_models: Path | None = None) -> list[ModelEntry]:
    """The demo model first (it is preselected on a first run), then the models folder, then the HF cache."""
    entries = []
    demo = paths.demo_model_dir()
    if is_model_dir(demo):
        entries.append(ModelEntry("demo-model", demo, "demo"))
    folder = stowage_models or paths.models_dir()
    for path in sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else ():
        if is_model_dir(path):
            entries.append(ModelEntry(path.name, path, "stowage"))
    entries.extend(_hf_cache_models(hf_cache or paths.hf_cache_dir()))
    return entries


def _hf_cache_models(hub: Path) -> list[ModelEntry]:
    """Models in a huggingface_hub cache: hub/models--org--name/snapshots/<revision>/, read offline.

    Reading the folder layout directly keeps huggingface_hub an optional package; the snapshot that
    refs/main names wins, else the newest complete one.
    """
    entries = []
    if not hub.is_dir():
        return entries
    for repo in sorted(hub.glob("models--*")):
        snapshots = repo / "snapshots"
        candidates = []
        ref = repo / "refs" / "main"
        if ref.is_file():
            candidates.append(snapshots / ref.read_text().strip())
        if snapshots.is_dir():
            candidates.extend(sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True))
        for snapshot in candidates:
            if snapshot.is_dir() and is_model_dir(snapshot):
                name = repo.name.removeprefix("models--").replace("--", "/")
                entries.append(ModelEntry(name, snapshot, "huggingface"))
                break
    return entries
