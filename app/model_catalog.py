"""The models the picker offers: the bundled demo first, then what engine/discovery finds (Stowage's models folder,
the HF cache, LM Studio's folder, Ollama's store), each opened where it lies."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from stowage.engine.formats.discovery import Places, discover, is_model_dir

from . import paths

_PLACES = {"demo": "demo", "huggingface": "HF cache", "lmstudio": "LM Studio", "ollama": "Ollama"}


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path
    source: str  # "demo" | "folder" | engine.discovery's FoundModel.source ("stowage", "huggingface", ...)
    quant: str | None = None  # "Q4_K_M", ...: what a GGUF file's blocks are

    @property
    def label(self) -> str:
        details = [d for d in (self.quant, _PLACES.get(self.source)) if d]
        return f"{self.name} ({', '.join(details)})" if details else self.name


def find_models(hf_cache: Path | None = None, stowage_models: Path | None = None, *,
                home: Path | None = None) -> list[ModelEntry]:
    """The demo model first (it is preselected on a first run), then every model engine/discovery finds."""
    entries = []
    demo = paths.demo_model_dir()
    if is_model_dir(demo):
        entries.append(ModelEntry("demo-model", demo, "demo"))
    places = Places.default(stowage_models or paths.models_dir(), home=home)
    if hf_cache is not None:
        places = replace(places, hf_cache=hf_cache)
    # a store that cannot be read costs a note, never the picker; the notes are `stowage list`'s to print
    entries += [ModelEntry(m.name, m.path, m.source, m.quant) for m in discover(places).models]
    return entries
