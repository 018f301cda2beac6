"""The "Remote server" model source: OpenAI-compatible servers the user added, their models, and how the app asks.

A remote model runs on another machine (vLLM, Ray Serve LLM, llama.cpp's server, Ollama, another `stowage serve`):
nothing is known here about that machine's memory, so it has no forecast and no graphs; its context is the server's
`max_model_len` where the server says it, and the server applies the chat template.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from urllib.parse import urlsplit

from PySide6.QtCore import QObject, QSettings, QThread, Signal, Slot

from stowage.engine.process.client import RemoteServer
from stowage.engine.defaults import DEFAULT_CONTEXT
from stowage.engine.errors import InvalidArgumentError, RemoteError, StowageError

ASK_SECONDS = 10.0  # how long a server may take to list its models before it counts as not answering
SETTINGS_KEY = "remote_servers"


@dataclass(frozen=True)
class RemoteModel:
    """One model a server lists."""

    base_url: str  # as RemoteServer keeps it: without the trailing /v1
    model_id: str
    max_model_len: int | None = None  # the server's context per sequence, where it says (Stowage, vLLM)

    @property
    def context_tokens(self) -> int:
        """The context the app fits a chat into: the server's, or engine.defaults' when the server does not say."""
        return self.max_model_len or DEFAULT_CONTEXT

    @property
    def host(self) -> str:
        return urlsplit(self.base_url).netloc or self.base_url

    @property
    def label(self) -> str:
        return f"{self.model_id} (server {self.host})"

    @property
    def ref(self) -> str:
        """What names it in the settings ("last_model", beside a folder's path)."""
        return f"remote:{self.base_url}#{self.model_id}"

    @property
    def settings_group(self) -> str:
        """Its QSettings group for per-model settings (model_settings._group)."""
        digest = hashlib.sha1(f"{self.base_url}#{self.model_id}".encode()).hexdigest()[:10]
        return f"remote/{self.model_id.replace('/', '_')}-{digest}"


def normalize_url(url: str) -> str:
    """The base URL as RemoteServer keeps it ('http://' added when no scheme is typed)."""
    url = url.strip()
    if url and "://" not in url:
        url = "http://" + url
    return url.rstrip("/").removesuffix("/v1")


def list_models(server: RemoteServer) -> list[RemoteModel]:
    """The server's models (GET /v1/models); the client's typed errors, or RemoteError for an answer of another
    shape."""
    models = []
    try:
        for entry in server.models(timeout=ASK_SECONDS):
            length = entry.get("max_model_len")
            models.append(RemoteModel(server.base_url, str(entry["id"]),
                                      length if isinstance(length, int) and length > 0 else None))
    except (KeyError, TypeError, AttributeError):
        raise RemoteError(f"{server.base_url}/v1/models did not list models: is it an OpenAI-compatible "
                          "server?") from None
    return models


def connect(model: RemoteModel, api_key: str | None) -> tuple[RemoteServer, RemoteModel]:
    """A client of `model`'s server, and the model as the server lists it now (its context may have changed).

    Raises the client's typed errors (unreachable, a refused key), InvalidArgumentError when it is no longer listed."""
    server = RemoteServer(model.base_url, api_key)
    try:
        listed = {m.model_id: m for m in list_models(server)}
        if model.model_id not in listed:
            raise InvalidArgumentError(f"{model.base_url} no longer lists {model.model_id}; it lists "
                                       f"{', '.join(listed) or 'no models'}")
    except BaseException:
        server.close()
        raise
    return server, listed[model.model_id]


class ServerBook:
    """The servers the user added, remembered in QSettings with the models each listed last.

    An API key is written to the settings file (in plain text: there is no system keyring to put it in) only
    when the user ticks "Remember the key"; otherwise it is kept for this session only."""

    def __init__(self, settings: QSettings):
        self.settings = settings
        self.servers: dict[str, dict] = {}  # base_url -> {"models": [...], "remember_key": bool}
        self.keys: dict[str, str] = {}  # base_url -> key, for this session
        try:
            saved = json.loads(settings.value(SETTINGS_KEY, "[]") or "[]")
        except (TypeError, ValueError):
            saved = []
        for entry in saved if isinstance(saved, list) else []:
            try:
                url = entry["url"]
                models = [RemoteModel(url, m["id"], m.get("max_model_len")) for m in entry.get("models", [])]
            except (KeyError, TypeError):
                continue  # a hand-edited entry: dropped, never the window
            self.servers[url] = {"models": models, "remember_key": bool(entry.get("api_key"))}
            if entry.get("api_key"):
                self.keys[url] = entry["api_key"]

    def models(self) -> list[RemoteModel]:
        return [m for server in self.servers.values() for m in server["models"]]

    def key_for(self, base_url: str) -> str | None:
        return self.keys.get(base_url)

    def add(self, base_url: str, api_key: str | None, remember_key: bool) -> None:
        """Note a server and its key before it answered (add_models keeps it once it does)."""
        if api_key:
            self.keys[base_url] = api_key
        else:
            self.keys.pop(base_url, None)
        entry = self.servers.get(base_url, {"models": []})
        entry["remember_key"] = remember_key and bool(api_key)
        self.servers[base_url] = entry

    def set_models(self, base_url: str, models: list[RemoteModel]) -> None:
        self.servers.setdefault(base_url, {"remember_key": False})["models"] = list(models)
        self._save()

    def remove(self, base_url: str) -> None:
        self.servers.pop(base_url, None)
        self.keys.pop(base_url, None)
        self._save()

    def _save(self) -> None:
        entries = []
        for url, server in self.servers.items():
            entry = {"url": url, "models": [{"id": m.model_id, "max_model_len": m.max_model_len}
                                            for m in server["models"]]}
            if server.get("remember_key") and self.keys.get(url):
                entry["api_key"] = self.keys[url]
            entries.append(entry)
        self.settings.setValue(SETTINGS_KEY, json.dumps(entries))


class TokenEstimate:
    """Counts a remote chat's prompt for the context policy without the model's tokenizer (the server has it).

    A character count times tokens per character, plus each message's template tokens; it starts high (1 token for
    3 characters: English text is ~4 in BPE vocabularies, code and other languages fewer) and learns the ratio
    from the prompt_tokens the server reports after each reply."""

    PER_MESSAGE_TOKENS = 8  # role markers and separators of a typical chat template
    MARGIN = 1.1

    def __init__(self):
        self.tokens_per_char = 1 / 3

    def count(self, messages: list[dict]) -> int:
        chars = sum(len(m["content"]) for m in messages)
        return math.ceil(chars * self.tokens_per_char) + self.PER_MESSAGE_TOKENS * (len(messages) + 1)

    def learn(self, messages: list[dict], prompt_tokens: int) -> None:
        chars = sum(len(m["content"]) for m in messages)
        content_tokens = prompt_tokens - self.PER_MESSAGE_TOKENS * (len(messages) + 1)
        if chars >= 200 and content_tokens > 0:  # a few words say little about the ratio
            self.tokens_per_char = content_tokens / chars * self.MARGIN


class ServerProbe(QObject):
    """Asks servers for their models on its own thread (never the GUI's, never behind the engine's work)."""

    listed = Signal(str, object)  # base_url, [RemoteModel]
    failed = Signal(str, str)  # base_url, message

    @Slot(str, object)
    def list_models(self, base_url: str, api_key: str | None) -> None:
        server = RemoteServer(base_url, api_key)
        try:
            models = list_models(server)
        except StowageError as e:
            self.failed.emit(base_url, str(e))
            return
        finally:
            server.close()
        if models:
            self.listed.emit(base_url, models)
        else:
            self.failed.emit(base_url, f"{base_url} lists no models")


class ServerProbeClient(QObject):
    """GUI-thread handle on a ServerProbe in its thread."""

    _ask = Signal(str, object)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName("stowage-remote")
        self.probe = ServerProbe()
        self.probe.moveToThread(self.thread)
        self._ask.connect(self.probe.list_models)
        self.thread.start()

    def list_models(self, base_url: str, api_key: str | None) -> None:
        self._ask.emit(base_url, api_key)

    def shutdown(self) -> None:
        self.thread.quit()
        self.thread.wait()
