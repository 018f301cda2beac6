"""`stowage`: the desktop app with no command, the engine's commands (chat, generate, plan) otherwise.

The one place that knows both packages: engine/ never imports app/, and app/ starts the engine itself.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        from stowage.app.main import main as gui_main

        return gui_main()
    from stowage.engine.cli import main as engine_main

    return engine_main(args)


if __name__ == "__main__":
    sys.exit(main())
