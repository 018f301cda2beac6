"""Stowage desktop app: PySide6 widgets on top of the engine, which never imports Qt."""

from .qt_compat import guard_bool_refcount

guard_bool_refcount()  # before any signal is emitted (see qt_compat: a PySide6 6.12.0 bug)
