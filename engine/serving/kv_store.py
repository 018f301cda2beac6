"""Evicted conversations' K/V on disk, read back when the conversation resumes instead of being prefilled again.

One file per conversation under <kv_dir>/<model key>/: a fixed prefix, a JSON header, the token ids, then each
layer's held blocks (K, then V) in the cache dtype, then a CRC-32 of each block. The key names the model files
(path, size, mtime), the compute and cache dtypes and the block layout, so a changed model or cache dtype never
reads stale K/V. A file is written under a temporary name and renamed; it is read through numpy.memmap (nothing is
unpickled), only as many blocks as the prompt shares. A file that does not check out (short, a bad CRC, a header
that is not ours) is deleted and the prompt prefilled instead. The folder holds at most the plan's
`kv_disk_bytes`; the least recently used files go first (docs/kv-store.md).

The disk never fails a request (docs/robustness.md): only regular files are opened (a FIFO named like an entry
would block the open), a file that cannot be deleted is left there and forgotten, and a store that cannot write
(a read-only or full disk) turns itself off: one warning line, then evicted conversations are dropped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..defaults import KV_DIR_ENV
from ..runtime.generation import common_prefix
from ..runtime.kv_cache import KVCache, Sequence, ceil_div

log = logging.getLogger(__name__)

MAGIC = b"STOWKV01"
PREFIX = struct.Struct("<8sII")  # magic, header bytes, CRC-32 of the header and the token ids
ALIGN = 64  # the blocks start here-aligned, so every block is viewed in place as the cache dtype
MAX_HEADER_BYTES = 1 << 16  # ours are ~100 bytes: a larger length is a damaged prefix, not a read of gigabytes
MAX_TOKENS = 1 << 24  # likewise: no context is longer (a file from a longer context than this one's is fine)
STALE_TMP_SECONDS = 3600  # a temporary file this old is a write that never finished


def default_kv_dir() -> Path:
    """$STOWAGE_KV_DIR, else the user cache dir's `kv` folder."""
    override = os.environ.get(KV_DIR_ENV)
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_cache_dir("Stowage", appauthor=False)) / "kv"


def model_key(model_path: str | Path, compute_dtype: str, cache: KVCache) -> str:
    """What a conversation's K/V depend on: the model's files, the compute and cache dtypes, the block layout, and
    the rotation of rows in blocks (entries written before rows were rotated are never read as rotated ones)."""
    path = Path(model_path).resolve()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    spec = cache.spec
    identity = {
        "path": str(path), "files": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files],
        "dtype": compute_dtype, "kv_dtype": str(spec.dtype) if spec.value_dtype == spec.dtype
        else f"{spec.dtype}/{spec.value_dtype}", "block_size": spec.block_size,
        "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "windows": [g.window for g in cache.groups], "layer_group": cache.layer_group,
    }
    if any(spec.rotations):  # named only where rows are rotated: a float cache's entries keep their key
        identity["rotations"] = spec.rotations
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:24]


class CorruptEntry(Exception):
    """A file that is not a whole, intact entry of this store."""


class NotRegularFile(Exception):
    """A FIFO, a folder, a device where an entry's file should be: not ours, never read."""


@dataclass(eq=False)
class Entry:
    """One conversation on disk: its tokens, and from which logical block each cache group's layers hold K/V."""

    path: Path
    token_ids: list[int]
    firsts: list[int]
    data_offset: int
    num_bytes: int


class KVStore:
    """The files of one model (one key) in a folder shared under one byte budget."""

    def __init__(self, folder: str | Path, key: str, budget_bytes: int, cache: KVCache):
        self.folder, self.key, self.budget_bytes, self.cache = Path(folder), key, budget_bytes, cache
        self.dir = self.folder / key
        self.kv_block_bytes = cache.spec.kv_block_bytes  # K's and V's of one block of one layer
        self.dir.mkdir(parents=True, exist_ok=True)
        self.entries: list[Entry] = []
        self.is_off = False  # a write failed: nothing is read or written any more
        now = time.time()
        for path in sorted(self.dir.iterdir()):
            if path.suffix == ".kv":
                try:
                    self.entries.append(self._read_header(path))
                except NotRegularFile:
                    log.warning("%s: not a regular file; ignored", path)
                except Exception as e:  # whatever a damaged header holds (JSON of another shape too)
                    error = _remove(path)
                    log.warning("%s: not a usable KV cache file (%s); %s", path, e,
                                "deleted" if error is None else f"cannot delete it ({error.strerror}), ignored")
            elif path.suffix == ".tmp" and now - _mtime(path) > STALE_TMP_SECONDS:
                _remove(path)

    @classmethod
    def of(cls, engine) -> "KVStore | None":
        """The engine's store as its plan says (kv_dir, kv_disk_bytes); None when the plan spills nothing."""
        plan = engine.plan
        if not plan.kv_disk_bytes:
            return None
        try:
            return cls(plan.kv_dir, model_key(engine.model_dir, plan.dtype, engine.cache), plan.kv_disk_bytes,
                       engine.cache)
        except OSError as e:
            log.warning("KV cache files off: cannot use %s (%s)", plan.kv_dir, e)
            return None

    @property
    def num_bytes(self) -> int:
        return sum(e.num_bytes for e in self.entries)

    # -- layout ----------------------------------------------------------------------------------
    def _held(self, num_tokens: int, firsts: list[int]) -> list[int]:
        """Blocks each layer's file section holds."""
        end = ceil_div(num_tokens, self.cache.spec.block_size)
        return [end - min(firsts[g], end) for g in self.cache.layer_group]

    def _sizes(self, head_bytes: int, num_tokens: int, firsts: list[int]) -> tuple[int, int]:
        """(where the blocks start, the file's size)."""
        data = -(-(head_bytes + 4 * num_tokens) // ALIGN) * ALIGN
        blocks = sum(self._held(num_tokens, firsts))
        return data, data + blocks * sum(self.kv_block_bytes) + 8 * blocks

    def stand_in(self, entry: Entry) -> Sequence:
        """A Sequence with the entry's tokens and which blocks it holds (no real ones): for KVCache.num_reusable."""
        end = ceil_div(len(entry.token_ids), self.cache.spec.block_size)
        seq = Sequence(token_ids=entry.token_ids)
        for g, first in zip(self.cache.groups, entry.firsts):
            g.table(seq)[:] = [-1] * min(first, end) + [0] * (end - min(first, end))
        return seq

    # -- the pool's side -------------------------------------------------------------------------
    def best(self, prompt_ids: list[int]) -> tuple[Entry | None, int]:
        """The entry that holds most of prompt_ids' K/V (at most all but the last token), and how many tokens."""
        best, reuse = None, 0
        for entry in self.entries:
            shared = min(common_prefix(entry.token_ids, prompt_ids), len(prompt_ids) - 1)
            n = self.cache.num_reusable(self.stand_in(entry), shared)
            if n > reuse:
                best, reuse = entry, n
        return best, reuse

    def save(self, seq: Sequence) -> None:
        """Write seq's tokens and K/V (what every layer holds of them); never raises for the disk's sake: a write
        that fails turns the store off."""
        if self.is_off:
            return
        tokens = list(seq.token_ids)
        same = next((e for e in self.entries if e.token_ids == tokens), None)
        if not tokens or same is not None:  # read back and not grown since: the file is still right
            if same is not None:
                self.touch(same)
            return
        firsts = [self.cache.held_range(seq, g)[0] for g in range(len(self.cache.groups))]
        header = json.dumps({"key": self.key, "num_tokens": len(tokens), "firsts": firsts}).encode()
        token_bytes = np.asarray(tokens, dtype="<i4").tobytes()
        data_offset, num_bytes = self._sizes(PREFIX.size + len(header), len(tokens), firsts)
        if num_bytes > self.budget_bytes:
            return
        path = self.dir / (hashlib.sha256(token_bytes).hexdigest()[:24] + ".kv")
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
        try:
            self._make_room(num_bytes)
            with open(tmp, "wb") as f:
                f.write(PREFIX.pack(MAGIC, len(header), zlib.crc32(header + token_bytes)))
                f.write(header + token_bytes)
                f.write(b"\0" * (data_offset - f.tell()))
                crcs = []
                for layer in range(len(self.cache.layer_group)):
                    for blocks in self.cache.export_layer(seq, layer):  # [n, block_size, heads, dim]
                        rows = blocks.contiguous().view(torch.uint8).reshape(len(blocks), -1).numpy()
                        crcs.extend(zlib.crc32(row) for row in rows)
                        f.write(rows)
                f.write(np.asarray(crcs, dtype="<u4").tobytes())
            os.replace(tmp, path)
        except OSError as e:  # read-only, full, gone: a disk that refused one write refuses the next
            _remove(tmp)
            self.is_off = True
            self.entries.clear()
            log.warning("KV cache files off: cannot write to %s (%s); conversations evicted from now on are "
                        "prefilled again when they resume", self.dir, e.strerror or e)
            return
        entry = Entry(path, tokens, firsts, data_offset, num_bytes)
        for old in [e for e in self.entries if common_prefix(e.token_ids, tokens) == len(e.token_ids)]:
            if self.cache.num_reusable(self.stand_in(entry), len(old.token_ids)) == len(old.token_ids):
                error = self._delete(old)  # the new file serves every prompt the old one did
                if error is not None:
                    log.warning("%s: cannot delete it (%s); left there, unused", old.path, error.strerror)
        self.entries.append(entry)

    def load(self, entry: Entry, num_tokens: int, seq: Sequence) -> bool:
        """Read the entry's first num_tokens tokens' K/V into fresh blocks of the empty seq; False (seq left empty,
        a bad file deleted) when it cannot."""
        bs, spec = self.cache.spec.block_size, self.cache.spec
        try:
            with _open_regular(entry.path) as f:
                data = np.memmap(f, dtype=np.uint8, mode="c")  # copy-on-write: a writable view, file untouched
            if data.size != entry.num_bytes:
                raise CorruptEntry(f"{data.size} bytes, the header says {entry.num_bytes}")
            self.cache.adopt(seq, entry.token_ids[:num_tokens], entry.firsts)
            held = self._held(len(entry.token_ids), entry.firsts)
            used = self._held(num_tokens, entry.firsts)
            crcs = data[entry.num_bytes - 8 * sum(held):].view("<u4")
            offset, index = entry.data_offset, 0
            for layer, (n_held, n_used) in enumerate(zip(held, used)):
                kv = []
                for dtype, block_bytes in zip((spec.dtype, spec.value_dtype), self.kv_block_bytes):  # K, then V
                    blocks = data[offset: offset + n_used * block_bytes]
                    for i in range(n_used):
                        if zlib.crc32(blocks[i * block_bytes: (i + 1) * block_bytes]) != crcs[index + i]:
                            raise CorruptEntry(f"layer {layer}: block {i} does not match its CRC")
                    # [n_used, block_size, heads, dim (q8_0 / q4_0: its blocks' bytes)] viewed in place in the file
                    kv.append(torch.from_numpy(blocks).view(dtype).view(n_used, bs, *spec.row_shape(dtype)))
                    offset += n_held * block_bytes
                    index += n_held
                self.cache.import_layer(seq, layer, *kv)
        except (OSError, ValueError, CorruptEntry, NotRegularFile) as e:
            self.cache.release(seq)
            error = self._delete(entry)
            log.warning("%s: cannot read it back (%s); %s, the prompt is prefilled", entry.path, e,
                        "deleted" if error is None else f"cannot delete it ({error.strerror}), left there unused")
            return False
        except Exception:  # no blocks to hold it after all, or a bug: prefill instead, keep the file
            log.exception("reading %s back failed; the prompt is prefilled", entry.path)
            self.cache.release(seq)
            return False
        self.touch(entry)
        return True

    # -- files -----------------------------------------------------------------------------------
    def _read_header(self, path: Path) -> Entry:
        with _open_regular(path) as f:
            prefix = f.read(PREFIX.size)
            if len(prefix) < PREFIX.size:
                raise CorruptEntry("shorter than its prefix")
            magic, head_len, crc = PREFIX.unpack(prefix)
            if magic != MAGIC or head_len > MAX_HEADER_BYTES:
                raise CorruptEntry("not a Stowage KV cache file")
            header = f.read(head_len)
            fields = json.loads(header)
            num_tokens, firsts = int(fields["num_tokens"]), [int(x) for x in fields["firsts"]]
            if not 0 < num_tokens <= MAX_TOKENS or len(firsts) != len(self.cache.groups):
                raise CorruptEntry("its layout is not this cache's")
            token_bytes = f.read(4 * num_tokens)
            file_bytes = os.fstat(f.fileno()).st_size
        if zlib.crc32(header + token_bytes) != crc or fields.get("key") != self.key:
            raise CorruptEntry("its header does not match its CRC or this model")
        data_offset, num_bytes = self._sizes(PREFIX.size + head_len, num_tokens, firsts)
        if file_bytes != num_bytes:
            raise CorruptEntry(f"{file_bytes} bytes, {num_bytes} expected (truncated?)")
        tokens = np.frombuffer(token_bytes, dtype="<i4").tolist()
        return Entry(path, tokens, firsts, data_offset, num_bytes)

    def _make_room(self, num_bytes: int) -> None:
        """Delete the least recently used files of the whole folder (every model's) until num_bytes more fit."""
        files = []
        for path in self.folder.glob("*/*.kv"):
            try:
                st = path.stat()
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):  # a folder or a FIFO named like an entry is not ours
                files.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total + num_bytes <= self.budget_bytes:
                break
            mine = next((e for e in self.entries if e.path == path), None)
            if mine is not None:
                self.entries.remove(mine)
            if _remove(path) is None:  # else the write that needs the room says why, if it fails
                total -= size

    def touch(self, entry: Entry) -> None:
        """Mark the entry used now: the budget deletes it last."""
        try:
            os.utime(entry.path)  # the mtime orders the least recently used
        except OSError:
            pass

    def _delete(self, entry: Entry) -> OSError | None:
        """Forget the entry and delete its file; the error if the file stays (the caller says so, in its line)."""
        if entry in self.entries:
            self.entries.remove(entry)
        return _remove(entry.path)


def _open_regular(path: Path):
    """path opened to read, if it is a regular file (a link to one included); NotRegularFile if it is not.

    O_NONBLOCK lets a FIFO's open return at once instead of waiting for a writer; a regular file's reads ignore it."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(f"{path.name}: not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _remove(path: Path) -> OSError | None:
    """Delete path if it is there; the OSError that kept it (a read-only disk, a folder in its place), else None."""
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        return e
    return None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()  # gone meanwhile, or unreadable: not stale
