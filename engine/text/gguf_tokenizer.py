"""The tokenizer a GGUF file describes in its metadata, built with the `tokenizers` library (no BPE of our own).

`tokenizer.ggml.model` "gpt2": byte-level BPE from the tokens and merges, text split first by the regex
that `tokenizer.ggml.pre` names (the one the vocabulary was trained with). "llama": SentencePiece BPE
from the tokens and scores, with byte fallback; the merges are recovered from the scores the way
transformers converts a SentencePiece model, and the pipeline is Llama-2's tokenizer.json (a "▁"
prefix on every run of text, as llama.cpp does too), or Gemma's when `tokenizer.ggml.add_space_prefix` is false
(no prefix, no strip when decoding). Control tokens become special tokens, so they
are matched whole; `tokenizer.huggingface.json`, when a file carries it, is used as it is.

Building one takes seconds for a large SentencePiece vocabulary (the merges recovered from 262k scores), and both
the CLI and its engine child need it: `cached_tokenizer` builds it once per file identity (path, size, mtime,
inode) and keeps it on disk as the `tokenizers` library's own JSON, read back without parsing the GGUF file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from ..errors import ModelFormatError, UnsupportedModelError
from .tokenizer import Tokenizer, _rust_errors

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The split regexes of the pre-tokenizers llama.cpp names (src/llama-vocab.cpp), as their tokenizer.json spell them.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")

# GPT-4o's o200k split (gpt-oss, Llama 4): upper- and lower-case runs apart, contractions as a word's suffix
_O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's Tekken (Nemo, Small 3.x): o200k's without the contractions, one digit at a time
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's own regex


def _smollm() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


# tokenizer.ggml.pre -> (pre-tokenizer, normalizer, ignore_merges): what that model's tokenizer.json holds.
PRE_TOKENIZERS = {
    "llama-bpe": (lambda: _split_then_bytes(_LLAMA3), None, True),  # Llama 3 (ignore_merges: whole words first)
    "llama3": (lambda: _split_then_bytes(_LLAMA3), None, True),
    "smaug-bpe": (lambda: _split_then_bytes(_LLAMA3), None, True),
    "qwen2": (lambda: _split_then_bytes(_QWEN2), normalizers.NFC, False),
    "deepseek-r1-qwen": (lambda: _split_then_bytes(_QWEN2), normalizers.NFC, False),
    "smollm": (_smollm, None, False),
    "gpt-4o": (lambda: _split_then_bytes(_O200K), None, False),  # gpt-oss
    "llama4": (lambda: _split_then_bytes(_O200K), None, False),
    "tekken": (lambda: _split_then_bytes(_TEKKEN), None, False),
    "gpt-2": (_gpt2, None, False),
    "default": (_gpt2, None, False),
}


class GGUFTokenizer(Tokenizer):
    """engine.tokenizer.Tokenizer over a `tokenizers` object built from GGUF metadata instead of tokenizer.json."""

    def __init__(self, tokenizer: HFTokenizer, bos_token: str | None, eos_token: str | None,
                 chat_template: str | None):
        # the same attributes Tokenizer.__init__ reads from a folder; every method is Tokenizer's
        self._tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template


TOKENIZER_DIR_ENV = "STOWAGE_TOKENIZER_DIR"  # where built tokenizers are kept (default: the user cache folder's)
CACHE_FORMAT = 1  # bump when what is built from a file changes: older entries are then never read
MAX_CACHED = 32  # tokenizers kept (the least recently used go first); a large one is ~12 MB


def tokenizer_cache_dir() -> Path:
    """$STOWAGE_TOKENIZER_DIR, else the user cache folder's `tokenizers`."""
    override = os.environ.get(TOKENIZER_DIR_ENV)
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_cache_dir("Stowage", appauthor=False)) / "tokenizers"


def cached_tokenizer(path: Path, metadata: Callable[[], Mapping], name: str) -> GGUFTokenizer:
    """The tokenizer of the GGUF file at `path` (the part holding the metadata): read back from the cache when this
    file, unchanged, built one before; else built from metadata() and cached. A cache that cannot be read or written
    (a damaged entry, a read-only folder) is rebuilt or skipped, never an error."""
    try:
        st = path.stat()
        identity = [CACHE_FORMAT, tokenizers.__version__, str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino]
    except OSError:  # a file known from its header alone (engine/hub): nothing on disk to key it by
        return tokenizer_from_gguf(metadata(), name)
    folder = tokenizer_cache_dir()
    key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:32]
    entry, tokenizer_file = folder / f"{key}.json", folder / f"{key}.tokenizer.json"
    found = _read_entry(entry, tokenizer_file, identity)
    if found is not None:
        return found
    built = tokenizer_from_gguf(metadata(), name)
    _write_entry(folder, entry, tokenizer_file, identity, built)
    return built


def _read_entry(entry: Path, tokenizer_file: Path, identity: list) -> GGUFTokenizer | None:
    try:
        meta = json.loads(entry.read_text(encoding="utf-8"))
        if meta.get("identity") != identity or tokenizer_file.stat().st_size != meta.get("tokenizer_bytes"):
            return None
        texts = [meta.get(k) for k in ("bos_token", "eos_token", "chat_template")]
        if not all(t is None or isinstance(t, str) for t in texts):
            return None
        tok = HFTokenizer.from_file(str(tokenizer_file))
        os.utime(entry)  # recently used: pruned last
    except Exception:  # missing, half-written or damaged (the Rust side raises a bare Exception): build it again
        return None
    return GGUFTokenizer(tok, *texts)


def _write_entry(folder: Path, entry: Path, tokenizer_file: Path, identity: list, built: GGUFTokenizer) -> None:
    # The tokenizer first, its entry last (each written whole, then renamed): an entry names a complete file.
    try:
        folder.mkdir(parents=True, exist_ok=True)
        text = built._tok.to_str()
        _replace(folder, tokenizer_file, text)
        _replace(folder, entry, json.dumps({
            "identity": identity, "tokenizer_bytes": len(text.encode("utf-8")), "bos_token": built.bos_token,
            "eos_token": built.eos_token, "chat_template": built.chat_template}))
        _prune(folder)
    except OSError:
        pass


def _replace(folder: Path, path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".", suffix=".part")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:  # byte for byte, as tokenizer_bytes counts
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _prune(folder: Path) -> None:
    """Keep the MAX_CACHED most recently used tokenizers (and no write left unfinished an hour ago)."""
    for part in folder.glob(".*.part"):
        if part.stat().st_mtime < time.time() - 3600:
            part.unlink(missing_ok=True)
    entries = sorted(folder.glob("*[0-9a-f].json"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
    for old in entries[MAX_CACHED:]:
        old.unlink(missing_ok=True)
        old.with_name(old.name.removesuffix(".json") + ".tokenizer.json").unlink(missing_ok=True)


def tokenizer_from_gguf(metadata: Mapping, name: str) -> GGUFTokenizer:
    """The tokenizer of a GGUF file's metadata; raises ModelFormatError or UnsupportedModelError saying why not."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ModelFormatError(f"{name}: no token list (tokenizer.ggml.tokens) in the metadata; "
                               "Stowage needs the tokenizer the file was converted with")
    types = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelFormatError(f"{name}: {len(types):,} token types for {len(tokens):,} tokens; the file is corrupt")
    special = {key: _token_id(metadata, f"tokenizer.ggml.{key}_token_id", len(tokens), name)
               for key in ("bos", "eos", "unknown", "padding")}
    embedded = metadata.get("tokenizer.huggingface.json")
    model = metadata.get("tokenizer.ggml.model")
    if isinstance(embedded, str):
        tok = _from_json(embedded, name)
    elif model == "gpt2":
        tok = _byte_level_bpe(metadata, tokens, name)
    elif model == "llama":
        tok = _sentencepiece_bpe(metadata, tokens, special["unknown"], name)
    else:
        raise UnsupportedModelError(f"{name}: tokenizer model {model!r} is not supported "
                                    "(Stowage reads 'gpt2' byte-level BPE and 'llama' SentencePiece)")
    if not isinstance(embedded, str):
        _add_special_tokens(tok, tokens, types)
        _add_bos_eos(tok, metadata, tokens, special, default_bos=model == "llama")
    text = lambda i: None if i is None else tokens[i]  # noqa: E731
    return GGUFTokenizer(tok, text(special["bos"]), text(special["eos"]), _chat_template(metadata))


def _token_id(metadata: Mapping, key: str, num_tokens: int, name: str) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    if type(value) is not int or not 0 <= value < num_tokens:
        raise ModelFormatError(f"{name}: {key} is {value!r}, not a token id below {num_tokens:,}; the file is corrupt")
    return value


def _from_json(text: str, name: str) -> HFTokenizer:
    try:
        return HFTokenizer.from_str(text)
    except Exception as e:  # the Rust side raises a bare Exception
        raise ModelFormatError(f"{name}: tokenizer.huggingface.json cannot be read ({e})") from e


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)  # a repeated token keeps its first id, as llama.cpp's text_to_token
    return vocab


def _byte_level_bpe(metadata: Mapping, tokens: list[str], name: str) -> HFTokenizer:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedModelError(f"{name}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not one Stowage knows "
                                    f"({', '.join(PRE_TOKENIZERS)}); its text would be split wrongly")
    merges = metadata.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise ModelFormatError(f"{name}: a byte-level BPE tokenizer without merges (tokenizer.ggml.merges)")
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ModelFormatError(f"{name}: merge {merge!r} is not two tokens separated by a space")
        pairs.append((left, right))
    pre_tokenizer, normalizer, ignore_merges = PRE_TOKENIZERS[pre]
    # the library panics (a BaseException) on a merge whose result is not a token: a format error too
    with _rust_errors(f"{name}: the vocabulary and merges do not make a BPE model"):
        tok = HFTokenizer(models.BPE(_vocab(tokens), pairs, ignore_merges=ignore_merges, fuse_unk=False,
                                     byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizer()
    if normalizer is not None:
        tok.normalizer = normalizer()
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(metadata: Mapping, tokens: list[str], unk_id: int | None, name: str) -> HFTokenizer:
    scores = metadata.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise ModelFormatError(f"{name}: a SentencePiece tokenizer needs one score per token (tokenizer.ggml.scores)")
    vocab = _vocab(tokens)
    unk = tokens[unk_id] if unk_id is not None else None
    tok = HFTokenizer(models.BPE(vocab, _merges_from_scores(vocab, tokens, scores), unk_token=unk, fuse_unk=True,
                                 byte_fallback=True))
    prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _merges_from_scores(vocab: dict[str, int], tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best merged piece first (transformers' generate_merges, same order)."""
    merges = []
    for i, piece in enumerate(tokens):
        if vocab[piece] != i:
            continue
        local = [(piece[:k], piece[k:], scores[i]) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(tok: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    # matched whole wherever they appear in the text, never cut into pieces (llama.cpp does the same)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind in (CONTROL, UNKNOWN)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED])


def _add_bos_eos(tok: HFTokenizer, metadata: Mapping, tokens: list[str], special: dict, default_bos: bool) -> None:
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", default_bos) and special["bos"] is not None
    add_eos = metadata.get("tokenizer.ggml.add_eos_token", False) and special["eos"] is not None
    if not (add_bos or add_eos):
        return
    bos, eos = tokens[special["bos"]] if add_bos else None, tokens[special["eos"]] if add_eos else None
    single = " ".join(([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else []))
    pair = single + " " + " ".join(([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else []))
    used = {t: special[k] for t, k in ((bos, "bos"), (eos, "eos")) if t}
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(used.items()))


def _chat_template(metadata: Mapping) -> str | None:
    template = metadata.get("tokenizer.chat_template")
    return template if isinstance(template, str) else None
