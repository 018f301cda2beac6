"""tokenizer.json through the `tokenizers` library, special tokens and chat template from the folder."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from . import chat_template
from ..formats.json_file import read_json_object, read_model_file
from ..errors import InvalidArgumentError, ModelFormatError, StowageWarning


def _token_text(config: dict, key: str) -> str | None:
    # "<s>", or {"content": "<s>", ...} as transformers writes an AddedToken
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ModelFormatError(f"tokenizer_config.json: {key} must be a token's text, got {value!r:.80}")
    return value


TOKENIZER_FILE = "tokenizer.json"  # the fast-tokenizer file of a Hugging Face folder


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / TOKENIZER_FILE
        if not path.exists():
            raise ModelFormatError(f"{model_dir.name}: no tokenizer.json (Stowage needs the fast-tokenizer file)")
        data = read_model_file(path)  # bounded: the whole vocabulary is parsed into memory
        with _rust_errors(f"{path.name}: cannot be read"):
            self._tok = _HFTokenizer.from_buffer(data)
        config_path = model_dir / "tokenizer_config.json"
        config = read_json_object(config_path) if config_path.exists() else {}
        self.bos_token = _token_text(config, "bos_token")
        self.eos_token = _token_text(config, "eos_token")
        self.chat_template = self._find_template(model_dir, config)

    @staticmethod
    def _find_template(model_dir: Path, config: dict) -> str | None:
        # transformers 5 writes chat_template.jinja beside the config; older files embed it.
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.exists():
            return _read_text(jinja_file)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            if not all(isinstance(t, dict) for t in template):
                raise ModelFormatError("tokenizer_config.json: chat_template must be text or a list of "
                                       "{\"name\", \"template\"} objects")
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if template is not None and not isinstance(template, str):
            raise ModelFormatError(f"tokenizer_config.json: chat_template must be text, got {template!r:.80}")
        return template

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def num_token_ids(self) -> int:
        """One past the largest id the tokenizer can produce: its vocabulary, added and special tokens included."""
        with _rust_errors("tokenizer.json: the tokenizer cannot list its vocabulary"):
            ids = list(self._tok.get_vocab(with_added_tokens=True).values())
        ids += self.encode("")  # what the post-processor adds (a BOS), whose id it states on its own
        return max(ids, default=-1) + 1

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (for libraries that take that file's text: llguidance)."""
        return self._tok.to_str()

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self._tok.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_text(text, "the text")
        with _rust_errors("tokenizer.json: the tokenizer failed on this text"):  # a file that loads can still panic
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        with _rust_errors("tokenizer.json: the tokenizer failed to decode tokens"):
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def use_builtin_template(self, model_type: str) -> chat_template.BuiltinTemplate | None:
        """Without a template of its own, take the architecture's built-in one (Gemma); returns it, or None."""
        builtin = chat_template.builtin_for(model_type) if self.chat_template is None else None
        if builtin is not None:
            self.chat_template, self.template_name = builtin.template, f"{builtin.name} (built in)"
        return builtin

    @property
    def template_source(self) -> str:
        """Which chat template is in use: the model's, a built-in one, or the plain fallback (for the GUI)."""
        if self.chat_template is None:
            return "plain (the model has no template)"
        return getattr(self, "template_name", "the model's own")

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        template = self.chat_template
        if template is None:
            warnings.warn("model has no chat template; using a plain 'Role: text' format", StowageWarning, stacklevel=2)
            template = chat_template.FALLBACK_TEMPLATE
        return chat_template.render(
            template, messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", tools=tools,
        )

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        # The template writes its own special tokens (BOS included), as transformers does.
        ids = self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)
        if not ids:
            raise chat_template.TemplateError("the chat template wrote nothing for this conversation; "
                                              "use the model's published template")
        return ids

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


@contextmanager
def _rust_errors(what: str):
    """A bare Exception from the Rust side, or a Rust panic (pyo3's PanicException, a BaseException), as a
    ModelFormatError saying `what`."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        raise ModelFormatError(f"{what} ({e})") from e


def check_text(text: str, what: str) -> None:
    """Refuse text that is not a str or cannot be UTF-8 (undecodable bytes that Python kept as lone surrogates)."""
    if not isinstance(text, str):
        raise InvalidArgumentError(f"{what} must be text, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(
            f"{what} is not valid UTF-8 (undecodable byte at character {e.start}); save it as UTF-8 and try again"
        ) from None


def _read_text(path: Path) -> str:
    try:
        return read_model_file(path).decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ModelFormatError(f"{path}: not UTF-8 text (at byte {e.start})") from None


class StreamDecoder:
    """Turns tokens into text deltas, holding back bytes of a character that is not complete yet."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # decode from here so merges/spaces at the boundary come out right
        self._read_offset = 0  # tokens up to here are already emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return new_text[len(prefix_text) :]
        return ""
