"""Stowage desktop app: PySide6 widgets on top of the engine, which never imports Qt."""
