"""What the Serve switch asks of the engine: where it listens for other programs, how many sequences it serves at
once, and the key that lasts between runs (QSettings). No widgets here: app/serve_switch.py shows and edits it."""

from __future__ import annotations

import secrets
import socket
from dataclasses import dataclass, replace

from stowage.engine.process.engine_process import CAN_UNIX
from stowage.engine.protocol import DEFAULT_HOST, DEFAULT_PORT

ANY_ADDRESS = "0.0.0.0"  # every network address of this machine: other computers reach it
DEFAULT_SEQUENCES = 2  # the window's chat and one other program, neither waiting for the other
MAX_SEQUENCES = 16
KEY_BYTES = 32
# QSettings keys ("serve" is the switch, as before the other settings existed)
_KEYS = {"on": "serve", "port": "serve_port", "other_computers": "serve_other_computers",
         "num_seqs": "serve_sequences", "api_key": "serve_key"}


def new_key() -> str:
    return secrets.token_urlsafe(KEY_BYTES)


@dataclass(frozen=True)
class ServeSettings:
    """Serve on or off, and how: a port (0: any free one), this computer only or every address, sequences."""

    on: bool = False
    port: int = DEFAULT_PORT
    other_computers: bool = False
    num_seqs: int = DEFAULT_SEQUENCES
    api_key: str = ""

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ServeSettings.port must be in 0..65535, got {self.port}")
        if not 1 <= self.num_seqs <= MAX_SEQUENCES:
            raise ValueError(f"ServeSettings.num_seqs must be in 1..{MAX_SEQUENCES}, got {self.num_seqs}")
        if self.on and not self.api_key:
            raise ValueError("ServeSettings: serving needs an API key")

    @property
    def host(self) -> str:
        return ANY_ADDRESS if self.other_computers else DEFAULT_HOST

    @property
    def plan_seqs(self) -> int:
        """Sequences the plan holds KV cache for: the chat's alone while nothing is served."""
        return self.num_seqs if self.on else 1

    def listening(self) -> "ServeSettings | None":
        """What the engine's start depends on: these settings while on; None while off (then the engine's port and
        key are private, and changing the others asks for no restart)."""
        return self if self.on else None

    def listen(self) -> dict:
        """EngineProcess.start's listening arguments: here, or for the app alone on a private Unix socket (a
        loopback port where there are none) with a key of its own."""
        if self.on:
            return {"port": self.port, "host": self.host, "api_key": self.api_key}
        return {"unix": CAN_UNIX}


def port_taken(settings: ServeSettings) -> bool:
    """Whether another program listens on the port `settings` ask for (any free port, or Serve off: never)."""
    if not settings.on or settings.port == 0:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is not "taken"
        try:
            probe.bind((settings.host, settings.port))
        except OSError:
            return True
    return False


def taken_message(settings: ServeSettings) -> str:
    return (f"Port {settings.port} is taken by another program: the model stays loaded for this app alone. Choose "
            "another port (or Any free port), or untick Serve.")


def restart_message(before: ServeSettings, after: ServeSettings) -> str:
    """What the load line says while the engine restarts to listen as `after` says."""
    if not after.on:
        return "Restarting the engine for this app alone"
    if before.on and after.api_key != before.api_key:
        return "Restarting the engine with the new key"
    return f"Restarting the engine on {'any free port' if after.port == 0 else f'port {after.port}'}"


def load_serve_settings(qsettings) -> ServeSettings:
    """The settings kept in QSettings; the key is generated on the first run and kept from then on."""
    defaults = ServeSettings()
    values = {}
    for name, key in _KEYS.items():
        value, default = qsettings.value(key, None), getattr(defaults, name)
        if value is None:
            continue
        try:
            values[name] = (value in (True, "true") if isinstance(default, bool) else
                            int(value) if isinstance(default, int) else str(value))
        except (TypeError, ValueError):
            pass  # an edited file: the default
    if not values.get("api_key"):
        values["api_key"] = new_key()
        qsettings.setValue(_KEYS["api_key"], values["api_key"])
    try:
        return ServeSettings(**values)
    except ValueError:  # out of range in an edited file
        return replace(defaults, api_key=values["api_key"])


def save_serve_settings(qsettings, settings: ServeSettings) -> None:
    for name, key in _KEYS.items():
        qsettings.setValue(key, getattr(settings, name))


def lan_address() -> str | None:
    """This machine's address on its network (the one its default route leaves from), or None without one."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: a UDP connect picks the route and sends nothing
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") or address == ANY_ADDRESS else address


def url_for_others(url: str, settings: ServeSettings) -> str:
    """The engine's base URL (on loopback) as other computers reach it: with this machine's network address."""
    address = lan_address() if settings.other_computers else None
    if address is None:
        return url
    scheme, _, rest = url.partition("://")
    _, _, port_path = rest.partition(":")
    return f"{scheme}://{address}:{port_path}"
