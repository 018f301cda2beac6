"""What the engine process and its clients agree on: the API key's variable, the default address (and what counts
as loopback), the base URL of a server on a Unix socket, and the progress lines a loading server writes on stderr
for its parent to read."""

from __future__ import annotations

import ipaddress
import re
import sys

API_KEY_ENV = "STOWAGE_API_KEY"  # the key without putting it on the command line (where `ps` shows it)
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
UNIX_SCHEME = "unix:"  # the base URL of a server on a Unix socket, `unix:/path/to.sock` (serve --unix; the client)
STDIN_REQUEST = "-"  # `serve --plan-request -`: the plan request follows on stdin, one line of JSON
_PROGRESS = re.compile(r"\[\s*(\d+(?:\.\d+)?)%\] (.*)")


def write_progress(fraction: float, message: str) -> None:
    """Loading progress on stderr, `[ 45.0%] message`: redrawn in place on a terminal, a line each otherwise
    (a parent process reads them: parse_progress)."""
    line = f"[{fraction * 100:5.1f}%] {message}"
    if sys.stderr.isatty():
        sys.stderr.write(f"\r\033[K{line}" + ("\n" if fraction >= 1.0 else ""))
    else:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


def parse_progress(line: str) -> tuple[float, str] | None:
    """(fraction, message) of a line write_progress wrote; None for any other line."""
    match = _PROGRESS.fullmatch(line.strip())
    return (float(match[1]) / 100, match[2]) if match else None


def is_loopback(address: str) -> bool:
    """Whether an IP address is this machine's loopback (127.0.0.0/8, ::1, ::ffff:127.0.0.1); ValueError for a
    string that is no IP address."""
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)
