"""Render assets/icons/stowage.svg to the PNG sizes desktops ask for (assets/icons/stowage-N.png).

    QT_QPA_PLATFORM=offscreen .venv/bin/python scripts/make_icons.py

Rendering each size from the vector (rather than scaling one bitmap) keeps small icons sharp.
"""

from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication, QImage, QPainter
from PySide6.QtSvg import QSvgRenderer

ICONS = Path(__file__).resolve().parents[1] / "assets" / "icons"
SIZES = (16, 24, 32, 48, 64, 128, 256)


def render(svg: Path, size: int) -> QImage:
    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise SystemExit(f"{svg}: not a valid SVG")
    image = QImage(size, size, QImage.Format.Format_ARGB32)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    renderer.render(painter)
    painter.end()
    return image


def main() -> None:
    _app = QGuiApplication.instance() or QGuiApplication(sys.argv)
    for size in SIZES:
        out = ICONS / f"stowage-{size}.png"
        if not render(ICONS / "stowage.svg", size).save(str(out)):
            raise SystemExit(f"could not write {out}")
        print(out)


if __name__ == "__main__":
    main()
