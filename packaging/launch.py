"""PyInstaller's entry script: PyInstaller needs a file, the package exposes app.main:main."""

from app.main import main

if __name__ == "__main__":
    raise SystemExit(main())
