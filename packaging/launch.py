"""PyInstaller's entry script: the bundle's executable is `stowage` (stowage_entry.main).

With no arguments it opens the app; with arguments it runs the engine's commands, which is also how the app
starts its engine in a child process from a bundle (engine/engine_process.engine_command: there is no
interpreter there to run `python -m engine.cli`).
"""

from stowage_entry import main

if __name__ == "__main__":
    raise SystemExit(main())
