"""A repository's files as the models they make: each GGUF file (a split set as one), and the safetensors set with
the config and tokenizer files it needs; each with its quantization, size, and the hashes a download is checked by."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from ..formats.discovery import _QUANT_IN_NAME
from ..formats.gguf import part_paths

# What a safetensors model needs beside its weights (the config, the tokenizer and its chat template).
SAFETENSORS_EXTRAS = ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                      "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json")
NOT_MODELS = re.compile(r"mmproj|projector", re.IGNORECASE)  # vision projectors kept beside GGUF models
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
HASH_NAME = re.compile(r"[0-9A-Za-z][0-9A-Za-z_-]*")  # a commit or ETag a Hub sends: a hash, never a path


@dataclass(frozen=True)
class RemoteFile:
    """One file of a repository at one commit."""

    path: str  # in the repository: "Qwen3-0.6B-Q8_0.gguf", "model-00001-of-00002.safetensors"
    size: int
    sha256: str | None  # the LFS hash (None: a small file kept in git, identified by its blob id)
    blob_id: str | None

    @property
    def identity(self) -> str:
        """What names this content, whatever the revision: its LFS hash, else its git blob id, else its path."""
        return self.sha256 or self.blob_id or self.path


@dataclass(frozen=True)
class RemoteModel:
    """One model a repository offers: a GGUF file or split set, or the safetensors set."""

    repo: str
    revision: str  # the commit the files were listed at
    name: str  # the file (the first part of a split set), or "safetensors"
    format: str  # "gguf" | "safetensors"
    quant: str | None  # "Q4_K_M", "BF16", ...; None when the name does not say
    weights: tuple[RemoteFile, ...]  # every part or shard, in order
    extras: tuple[RemoteFile, ...] = ()  # config and tokenizer files (safetensors)

    @property
    def files(self) -> tuple[RemoteFile, ...]:
        return self.weights + self.extras

    @property
    def size_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class RepoFiles:
    """What a repository offers, at one commit."""

    repo: str
    revision: str
    models: tuple[RemoteModel, ...]
    gated_note: str | None = None  # how to get access, when the repository is gated

    def find(self, *, file: str | None = None, quant: str | None = None) -> RemoteModel:
        """The model named by a file (any part of a split set) or a quantization; with neither, the only one."""
        from ..errors import HubError

        if file is not None:
            found = [m for m in self.models if file in (m.name, *(f.path for f in m.files))]
            what = f"file {file!r}"
        elif quant is not None:
            found = [m for m in self.models if (m.quant or "").upper() == quant.upper()]
            what = f"{quant.upper()} model"
        else:
            found, what = list(self.models), "model Stowage can run"
        if len(found) == 1:
            return found[0]
        offered = ", ".join(f"{m.name} ({m.quant or m.format})" for m in self.models) or "nothing Stowage can run"
        if not found:
            raise HubError(f"{self.repo} has no {what}; it offers {offered}")
        raise HubError(f"{self.repo} holds {len(found)} models; choose one with --file or --quant: {offered}")


def sibling_files(info) -> dict[str, RemoteFile] | None:
    """The files of huggingface_hub's ModelInfo (asked with files_metadata=True); None if it lacks their sizes."""
    siblings = info.siblings or ()
    if any(s.size is None and s.lfs is None for s in siblings):
        return None
    return {s.rfilename: RemoteFile(s.rfilename, s.size if s.size is not None else s.lfs.size,
                                    s.lfs.sha256 if s.lfs else None, s.blob_id) for s in siblings}


def tree_files(entries) -> dict[str, RemoteFile]:
    """The files of a tree listing (huggingface_hub's RepoFile entries; folders left out)."""
    return {e.path: RemoteFile(e.path, e.size, e.lfs.sha256 if e.lfs else None, e.blob_id)
            for e in entries if hasattr(e, "size") and hasattr(e, "blob_id")}


def _safe(path: str) -> bool:
    """A relative path that stays inside the folder it is joined to (no "..", no root, no backslash)."""
    parts = PurePosixPath(path).parts
    return bool(parts) and not path.startswith("/") and "\\" not in path and ".." not in parts and ":" not in parts[0]


def group_files(repo: str, info, files: dict[str, RemoteFile], gated_note: str | None = None) -> RepoFiles:
    """The models among `files` (GGUF ones sorted by size) of the repository `info` describes."""
    from ..errors import HubError

    revision = info.sha or "main"  # a server that does not say the commit: its files as they are now
    if not HASH_NAME.fullmatch(revision):  # it names a folder of the cache
        raise HubError(f"the Hub named the commit of {repo} {revision!r:.80}: not a commit; refusing it")
    files = {path: f for path, f in files.items() if _safe(path)}  # a listed path is a path in the cache
    models = _gguf_models(repo, revision, files) + _safetensors_models(repo, revision, info, files)
    return RepoFiles(repo, revision, tuple(models), gated_note)


def _gguf_models(repo: str, revision: str, files: dict[str, RemoteFile]) -> list[RemoteModel]:
    sets: dict[str, list[RemoteFile]] = {}
    for path, f in files.items():
        if not path.lower().endswith(".gguf") or NOT_MODELS.search(path.rsplit("/", 1)[-1]):
            continue
        sets.setdefault(part_paths(PurePosixPath(path))[0].as_posix(), []).append(f)
    models = []
    for first, parts in sets.items():
        parts.sort(key=lambda f: f.path)
        if len(parts) != len(part_paths(PurePosixPath(first))):
            continue  # an incomplete split set cannot be loaded; offering it would waste a download
        quant = _QUANT_IN_NAME.search(first.rsplit("/", 1)[-1])
        models.append(RemoteModel(repo, revision, first, "gguf", quant[1].upper() if quant else None, tuple(parts)))
    return sorted(models, key=lambda m: (m.size_bytes, m.name))


def _safetensors_models(repo: str, revision: str, info, files: dict[str, RemoteFile]) -> list[RemoteModel]:
    weights = tuple(f for p, f in sorted(files.items()) if "/" not in p and p.endswith(".safetensors"))
    # transformers' names (model.safetensors, or shards model-00001-of-0000N.safetensors beside their index) win
    # over other copies some repositories keep beside them (Mistral's consolidated.safetensors)
    named = [f for f in weights if f.path == "model.safetensors"] or [f for f in weights if _SHARD.match(f.path)]
    weights = tuple(named) or weights
    if not weights or "config.json" not in files:
        return []
    dtypes = sorted((info.safetensors.parameters or {}).items(), key=lambda kv: -kv[1]) if info.safetensors else []
    quant = dtypes[0][0].upper() if dtypes else None
    extras = tuple(files[name] for name in SAFETENSORS_EXTRAS if name in files)
    return [RemoteModel(repo, revision, "safetensors", "safetensors", quant, weights, extras)]
