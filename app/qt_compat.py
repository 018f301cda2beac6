"""A guard against a PySide6 6.12.0 bug that would crash the app within minutes.

On Python 3.11, PySide6-Essentials 6.12.0 drops one reference to what a Python-called binding returns
when that is a singleton: `True` on every `Signal.emit()` and `connect()`, `None` on every void method
(`setText`, `update`, `resize`, `setValue`, ...). 6.11.2 does not (measured: tests/app/test_qt_compat.py).
These singletons are never meant to be freed: once a count reaches zero the interpreter aborts with
"bool_dealloc: deallocating True or False" or "none_dealloc: deallocating None". The app emits a
signal per generated token and redraws its graphs four times a second, so it would die mid-chat.
pyproject.toml excludes 6.12.0; this guard keeps an environment that already has it alive by doing
what Python 3.12 does for every singleton anyway: a reference count that can never reach zero.
"""

from __future__ import annotations

import ctypes
import sys
from importlib import metadata

BROKEN_VERSIONS = {"6.12.0"}
# Far more emits than a process makes in its life, far below the count's overflow.
EXTRA_REFERENCES = 1 << 40


def pyside_version() -> str | None:
    for name in ("PySide6-Essentials", "PySide6"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def needs_bool_guard() -> bool:
    return sys.version_info < (3, 12) and pyside_version() in BROKEN_VERSIONS


def guard_bool_refcount() -> bool:
    """Make None, True and False immortal when the broken PySide6 is installed; True if it did."""
    if not needs_bool_guard() or getattr(sys, "_stowage_bool_guard", False):
        return False
    for singleton in (None, True, False):
        # ob_refcnt is the first field of every CPython object.
        ctypes.c_ssize_t.from_address(id(singleton)).value += EXTRA_REFERENCES
    sys._stowage_bool_guard = True
    return True
