"""Models already on this machine, where people keep them: Stowage's models folder, the Hugging Face cache,
LM Studio's models folder and Ollama's store. Each is listed where it lies and opened there, never copied.

Ollama keeps a model as a manifest (manifests/<registry>/<namespace>/<model>/<tag>, JSON) that names its
layers by digest; the layer of mediaType `application/vnd.ollama.image.model` is a GGUF file stored as
blobs/sha256-<hex>, which engine/formats/gguf.py opens by its magic. A store that cannot be read (a manifest that
is not JSON, a blob that is missing) costs one note in `Discovery.notes`, never an exception.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from ..defaults import OPENED_MODELS_FILE, data_dir
from ..errors import ModelFormatError
from ..units import format_bytes

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY = "registry.ollama.ai"
MAX_FOLDER_DEPTH = 4  # LM Studio's publisher/repo/file.gguf, with room for one more level
# Keys a listing reads from a GGUF file (the vocabulary after them is never read).
_LISTED_KEYS = frozenset({"general.architecture", "general.file_type"})
DEMO_MODEL = Path(__file__).resolve().parents[2] / "assets" / "demo-model"  # as app/paths.py demo_model_dir
NOT_MODELS = frozenset({"clip"})  # general.architecture of vision projectors (mmproj-*.gguf) kept beside models
# A quantization in a file name, as llama.cpp's quantizers and uploaders write it: "...-Q4_K_M.gguf".
_QUANT_IN_NAME = re.compile(r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Z0-9]+)+|BF16|F16|F32)(?![A-Za-z0-9])", re.IGNORECASE)


@dataclass(frozen=True)
class FoundModel:
    """One model a user has: where it is, its format and size, and its quantization when the file says."""

    name: str
    path: Path  # what Engine.load, inspect and `stowage plan` take
    format: str  # "gguf" | "safetensors"
    size_bytes: int  # every file of the model (all parts of a split GGUF)
    quant: str | None  # "Q4_K_M", "Q8_0", "F16", ...; None when unknown
    source: str  # "stowage" | "huggingface" | "lmstudio" | "ollama"


@dataclass(frozen=True)
class Places:
    """Where to look; a None or absent folder is skipped."""

    stowage_models: Path | None = None
    hf_cache: Path | None = None
    lmstudio: tuple[Path, ...] = ()
    ollama: Path | None = None
    demo: Path | None = None  # the bundled demo model (`stowage list`; the app's picker adds it itself)
    opened: tuple[Path, ...] = ()  # folders and .gguf files opened in the app (app_opened_models)

    @classmethod
    def default(cls, stowage_models: Path | None, *, home: Path | None = None,
                env: Mapping[str, str] = os.environ) -> "Places":
        """The usual locations under `home`, honouring HF_HUB_CACHE / HF_HOME and OLLAMA_MODELS as those tools do."""
        home = Path.home() if home is None else home
        if env.get("HF_HUB_CACHE"):
            hf_cache = Path(env["HF_HUB_CACHE"])
        else:
            hf_cache = Path(env["HF_HOME"]) / "hub" if env.get("HF_HOME") else home / ".cache" / "huggingface" / "hub"
        ollama = Path(env["OLLAMA_MODELS"]) if env.get("OLLAMA_MODELS") else home / ".ollama" / "models"
        return cls(stowage_models, hf_cache, (home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"),
                   ollama)


@dataclass(frozen=True)
class Discovery:
    models: tuple[FoundModel, ...]
    notes: tuple[str, ...] = field(default=())  # what was skipped, and why


def discover(places: Places) -> Discovery:
    """Every model in `places`: the Stowage folder, then the HF cache, LM Studio and Ollama; each listed once
    (two Ollama tags of one blob are two names)."""
    found, notes = [], []
    if places.demo is not None and is_model_dir(places.demo):
        found.append(_hf_entry(places.demo, "demo-model", "demo"))
    for path in places.opened:
        if path.is_dir() and is_model_dir(path):
            found.append(_hf_entry(path, path.name, "app"))
        else:
            found += [_gguf_entry(p, _relative_name(p, p.parent), "app", notes) for p in _gguf_files(path)]
    if places.stowage_models is not None:
        found += _stowage_models(places.stowage_models, notes)
    if places.hf_cache is not None:
        found += _hf_cache_models(places.hf_cache, notes)
    roots = {root.resolve(): root for root in reversed(places.lmstudio)}  # its two folders are often one (a link)
    for root in reversed(roots.values()):
        found += [_gguf_entry(p, _relative_name(p, root), "lmstudio", notes) for p in _gguf_files(root)]
    if places.ollama is not None:
        found += _ollama_models(places.ollama, notes)
    seen, models = set(), []
    for model in filter(None, found):
        key = model.name, model.path.resolve()  # a file in two places under one name (a link) counts once
        if key not in seen:
            seen.add(key)
            models.append(model)
    return Discovery(tuple(models), tuple(notes))


# -- each place -------------------------------------------------------------------------------------


def is_model_dir(path: Path) -> bool:
    """A Hugging Face folder Stowage could load: config.json and safetensors weights (a pickle is never offered)."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def gguf_models(folder: Path, source: str = "folder") -> list[FoundModel]:
    """The GGUF models directly in a folder a user chose (Downloads, say), each named after its file; an unreadable
    file is left out."""
    notes: list[str] = []
    files = _gguf_files(folder, MAX_FOLDER_DEPTH - 1)  # its own files only: a Downloads folder is not walked
    found = [_gguf_entry(p, _relative_name(p, folder), source, notes) for p in files]
    return [m for m in found if m is not None]


def gguf_quant(path: Path) -> str | None:
    """The quantization of the GGUF model at `path` (a file, or a folder holding one) as a listing names it ("Q4_1");
    None when unknown."""
    from .gguf import find_gguf

    try:
        path = find_gguf(path)
    except ModelFormatError:
        return None
    entry = _gguf_entry(path, path.name, "folder", [])
    return entry.quant if entry is not None else None


def _hf_entry(path: Path, name: str, source: str) -> FoundModel:
    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return FoundModel(name, path, "safetensors", size, None, source)


def _stowage_models(folder: Path, notes: list[str]) -> list[FoundModel | None]:
    """Model folders, .gguf files, and folders of .gguf files dropped into Stowage's models folder."""
    out = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else ():
        if path.is_dir() and is_model_dir(path):
            out.append(_hf_entry(path, path.name, "stowage"))
        else:
            out += [_gguf_entry(p, _relative_name(p, folder), "stowage", notes) for p in _gguf_files(path)]
    return out


def _hf_cache_models(hub: Path, notes: list[str]) -> list[FoundModel | None]:
    """Models in a huggingface_hub cache: hub/models--org--name/snapshots/<revision>/, read offline: the safetensors
    model, and each GGUF model (named org/name/FILE) of the snapshot that refs/main names, else the newest one that
    holds any. A file is in a snapshot only once whole (downloads write blobs/*.incomplete, then link it)."""
    out = []
    for repo in sorted(hub.glob("models--*")) if hub.is_dir() else ():
        name = repo.name.removeprefix("models--").replace("--", "/")
        snapshots, ref = repo / "snapshots", repo / "refs" / "main"
        candidates = [snapshots / ref.read_text().strip()] if ref.is_file() else []
        if snapshots.is_dir():
            candidates += sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
        for snapshot in candidates:
            if not snapshot.is_dir():
                continue
            found = [_hf_entry(snapshot, name, "huggingface")] if is_model_dir(snapshot) else []
            found += [_gguf_entry(p, f"{name}/{_relative_name(p, snapshot)}", "huggingface", notes)
                      for p in _gguf_files(snapshot)]
            if found:
                out += found
                break
    return out


def _gguf_files(path: Path, depth: int = 0) -> list[Path]:
    """The GGUF models under `path` (itself, if a file): single files and the first part of split ones."""
    from .gguf import part_paths  # here, as every reader of GGUF files: `stowage --help` builds this parser

    if path.is_file():
        return [path] if path.suffix.lower() == ".gguf" and part_paths(path)[0] == path else []
    if not path.is_dir() or depth >= MAX_FOLDER_DEPTH:
        return []
    try:
        children = sorted(path.iterdir())
    except OSError:
        return []
    return [p for child in children for p in _gguf_files(child, depth + 1)]


def _relative_name(path: Path, root: Path) -> str:
    name = path.relative_to(root).as_posix()
    match = re.match(r"^(.+)-00001-of-\d{5}\.gguf$", name)
    return match[1] if match else name.removesuffix(".gguf").removesuffix(".GGUF")


def _gguf_entry(path: Path, name: str, source: str, notes: list[str], quant: str | None = None) -> FoundModel | None:
    """A GGUF model's entry, its quantization from general.file_type (else the name); None, noted, if unreadable."""
    from .gguf import FILE_TYPES, part_paths

    meta = _listed_metadata(path)
    if isinstance(meta, str):
        notes.append(f"{path}: skipped, not a readable GGUF file ({meta})")
        return None
    if meta.get("general.architecture") in NOT_MODELS:
        return None  # a vision projector beside its model, not a model
    size = sum(p.stat().st_size for p in part_paths(path) if p.is_file())
    file_type = meta.get("general.file_type")
    match = _QUANT_IN_NAME.search(path.name)
    quant = quant or FILE_TYPES.get(file_type) or (match[1].upper() if match else None)
    return FoundModel(name, path, "gguf", size, quant, source)


def _listed_metadata(path: Path) -> dict | str:
    """The keys a listing reads from a GGUF file, or why they cannot be read: once per file identity (its path, size,
    mtime and inode, as gguf_model.open_model), since every listing (each GET /stowage/models) asks again and a file
    can put a vocabulary of millions of entries before them."""
    try:
        st = path.stat()
    except OSError as e:
        return f"cannot read ({e.strerror})"
    return _read_listed(path.resolve(), st.st_size, st.st_mtime_ns, st.st_ino)


@lru_cache(maxsize=1024)  # entries of a few keys; far more GGUF files than anyone keeps
def _read_listed(path: Path, size: int, mtime_ns: int, inode: int) -> dict | str:
    from .gguf import read_metadata

    try:
        return read_metadata(path, _LISTED_KEYS)
    except ModelFormatError as e:
        return str(e)  # kept too: a damaged file is not read again until it changes


def _ollama_models(root: Path, notes: list[str]) -> list[FoundModel | None]:
    """Ollama's models: each manifest's model layer, a GGUF blob opened where it lies."""
    from .gguf import is_gguf_file

    manifests = root / "manifests"
    out = []
    # manifests/<registry>/<namespace>/<model>/<tag>
    for manifest in sorted(manifests.glob("*/*/*/*")) if manifests.is_dir() else ():
        if not manifest.is_file():
            continue
        registry, namespace, model, tag = manifest.relative_to(manifests).parts
        if registry == OLLAMA_REGISTRY:
            name = f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}"
        else:
            name = f"{registry}/{namespace}/{model}:{tag}"
        try:
            content = _read_json(manifest)
            digest = next(layer["digest"] for layer in content["layers"]
                          if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
            config_digest = (content.get("config") or {}).get("digest")
        except (OSError, ValueError, TypeError, AttributeError, KeyError, StopIteration):
            notes.append(f"Ollama model {name}: skipped, its manifest {manifest} is unreadable or names no model layer")
            continue
        blob = _blob(root, digest)
        if blob is None or not is_gguf_file(blob):
            notes.append(f"Ollama model {name}: skipped, its model layer {digest!r:.80} is missing or not a GGUF file")
            continue
        out.append(_gguf_entry(blob, name, "ollama", notes, _ollama_file_type(root, config_digest)))
    return out


def _blob(root: Path, digest) -> Path | None:
    """blobs/sha256-<hex> for the digest "sha256:<hex>"; None for anything else (a digest never names a path)."""
    match = re.fullmatch(r"sha256[:-]([0-9a-f]{64})", digest) if isinstance(digest, str) else None
    return root / "blobs" / f"sha256-{match[1]}" if match else None


def _ollama_file_type(root: Path, config_digest) -> str | None:
    """The quantization Ollama's config layer records ("file_type": "Q4_K_M"), if it is readable."""
    path = _blob(root, config_digest)
    try:
        file_type = _read_json(path).get("file_type") if path is not None else None
    except (OSError, ValueError, AttributeError):
        return None
    return file_type.upper() if isinstance(file_type, str) and file_type else None


def _read_json(path: Path):
    with open(path, "rb") as f:
        return json.loads(f.read(1 << 20))  # a manifest is a few hundred bytes; a huge one is not a manifest


# -- stowage list -----------------------------------------------------------------------------------


def format_table(models: tuple[FoundModel, ...]) -> str:
    """The models as a table: name, source, format, quantization, size, path."""
    rows = [("NAME", "SOURCE", "FORMAT", "QUANT", "SIZE", "PATH")]
    rows += [(m.name, m.source, m.format, m.quant or "-", format_bytes(m.size_bytes), str(m.path)) for m in models]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows)


def to_dict(discovery: Discovery) -> dict:
    """The JSON of `stowage list --json`."""
    return {"models": [asdict(m) | {"path": str(m.path)} for m in discovery.models], "notes": list(discovery.notes)}


def add_list_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `list` subcommand; its `func` prints the models found and returns 0."""
    p = subparsers.add_parser(
        "list", help="list the models on this machine (Stowage's folder, Hugging Face cache, LM Studio, Ollama)",
        description="List the models Stowage can open where they are: its own models folder, the Hugging Face "
                    "cache, LM Studio's models folder and Ollama's store. Nothing is copied.")
    p.add_argument("--models-dir", type=Path, default=None,
                   help="Stowage's models folder (default: the one the desktop app uses)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_list)
    return p


def run_list(args, *, places: Places | None = None, out=None) -> int:
    """`stowage list`: the table (or JSON) on stdout, notes on stderr."""
    out = out or sys.stdout
    if places is None:
        places = replace(Places.default(args.models_dir or default_models_dir()), demo=DEMO_MODEL,
                         opened=app_opened_models())
    discovery = discover(places)
    if args.json:
        out.write(json.dumps(to_dict(discovery), ensure_ascii=False) + "\n")
        return 0
    out.write((format_table(discovery.models) if discovery.models else "no models found") + "\n")
    for note in discovery.notes:
        sys.stderr.write(f"note: {note}\n")
    return 0


def default_models_dir(env: Mapping[str, str] = os.environ) -> Path:
    """The desktop app's models folder (app/paths.py models_dir): the data folder's models/."""
    return data_dir(env) / "models"


def app_opened_models(env: Mapping[str, str] = os.environ) -> tuple[Path, ...]:
    """The folders and .gguf files opened in the desktop app, as it last wrote them (remember_app_opened); none
    where the app never ran or the file cannot be read."""
    try:
        paths = json.loads((data_dir(env) / OPENED_MODELS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ()
    return tuple(Path(p) for p in paths if isinstance(p, str) and p) if isinstance(paths, list) else ()


def remember_app_opened(paths: list[str], env: Mapping[str, str] = os.environ) -> None:
    """Write the app's opened models where `stowage list` reads them (whole or not at all)."""
    folder = data_dir(env)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{OPENED_MODELS_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps([str(p) for p in paths], ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, folder / OPENED_MODELS_FILE)


