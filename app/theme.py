"""The app's colours, chosen for the current palette (light or dark) so text stays readable on its background;
and the theme the user chose in View ▸ Theme ("system", "light" or "dark"), applied to the application's palette.

Widgets that draw with colours of their own (style sheets, graphs, the plan bar) read `colors()` when they style
themselves and restyle through `watch(widget, restyle)`, which fires after every palette change: the user's
choice, or the system switching between light and dark while the choice is "system".
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QEvent, QObject, Qt, Signal, Slot
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication, QStyleFactory

THEMES = ("system", "light", "dark")


@dataclass(frozen=True)
class Colors:
    """Colours as '#rrggbb' strings, ready for style sheets."""

    is_dark: bool
    text: str  # the palette's own text colour, for text on the backgrounds below
    chat_background: str  # behind the messages
    user_background: str
    user_border: str
    assistant_background: str
    assistant_border: str
    code_background: str  # fenced code blocks in a message
    muted: str  # notes, figures, placeholders
    link: str  # small flat buttons in a message (Copy, Edit, ‹ ›)
    error: str
    warning: str  # what an edit will do, notices that are not errors
    marker: str  # the line where the model's memory resumes
    pygments_style: str  # the syntax-highlighting style for code blocks
    ok: str  # "Loaded", a plan that fits
    plot_background: str  # the memory graphs
    plot_foreground: str  # their axes, ticks and titles
    series: tuple[str, ...]  # graph lines, one per GPU / quantity
    predicted: str  # the dashed "predicted" RAM line
    free: str  # the unused part of the plan bar


LIGHT = Colors(
    is_dark=False, text="#1f1f1f", chat_background="#f7f7f7", user_background="#eef3fb", user_border="#d5e0f0",
    assistant_background="#ffffff", assistant_border="#e2e2e2", code_background="#f3f4f6", muted="#666666",
    link="#3465a4", error="#b00020", warning="#8a5a00", marker="#a0522d", pygments_style="default",
    ok="#1b5e20", plot_background="#ffffff", plot_foreground="#333333",
    series=("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2"), predicted="#d62728", free="#e8e8e8",
)
# Lighter tones of the same hues: each keeps at least 4.5:1 contrast on its dark background.
DARK = Colors(
    is_dark=True, text="#e6e6e6", chat_background="#1e1f22", user_background="#24324a", user_border="#34496b",
    assistant_background="#2b2d31", assistant_border="#3c3f45", code_background="#18191c", muted="#a8a8a8",
    link="#8ab4f8", error="#ff7b7b", warning="#e0b050", marker="#e0a070", pygments_style="monokai",
    ok="#7bd88f", plot_background="#1e1f22", plot_foreground="#c8c8c8",
    series=("#5aa9e6", "#ffa24c", "#5cc85c", "#b594e0", "#c49a8c", "#f08fd0"), predicted="#ff6b6b", free="#3a3c40",
)


def is_dark(palette: QPalette | None = None) -> bool:
    """A palette whose window is darker than its text is a dark one."""
    palette = palette or QGuiApplication.palette()
    window, text = palette.color(QPalette.ColorRole.Window), palette.color(QPalette.ColorRole.WindowText)
    return window.lightnessF() < text.lightnessF()


def colors(palette: QPalette | None = None) -> Colors:
    """The colours for `palette` (default: the application's): LIGHT or DARK, with the palette's own text colour."""
    palette = palette or QGuiApplication.palette()
    base = DARK if is_dark(palette) else LIGHT
    text = palette.color(QPalette.ColorRole.Text).name()
    return Colors(**{**base.__dict__, "text": text}) if _contrast(text, base.assistant_background) >= 4.5 else base


def _luminance(color: str) -> float:
    """WCAG relative luminance of '#rrggbb'."""
    def channel(c: float) -> float:
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    q = QColor(color)
    return 0.2126 * channel(q.redF()) + 0.7152 * channel(q.greenF()) + 0.0722 * channel(q.blueF())


def _contrast(a: str, b: str) -> float:
    """WCAG contrast ratio of two colours (1 to 21; 4.5 is readable body text)."""
    la, lb = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


contrast = _contrast


# -- the user's choice: light, dark, or the system's --------------------------------------------------
def dark_palette() -> QPalette:
    """A dark palette for every role (disabled text dimmed)."""
    palette = QPalette()
    roles = {
        QPalette.ColorRole.Window: "#2b2d31", QPalette.ColorRole.WindowText: "#e6e6e6",
        QPalette.ColorRole.Base: "#1e1f22", QPalette.ColorRole.AlternateBase: "#26282c",
        QPalette.ColorRole.ToolTipBase: "#2b2d31", QPalette.ColorRole.ToolTipText: "#e6e6e6",
        QPalette.ColorRole.PlaceholderText: "#8c8c8c", QPalette.ColorRole.Text: "#e6e6e6",
        QPalette.ColorRole.Button: "#33363b", QPalette.ColorRole.ButtonText: "#e6e6e6",
        QPalette.ColorRole.BrightText: "#ff7b7b", QPalette.ColorRole.Light: "#45484e",
        QPalette.ColorRole.Midlight: "#3a3d42", QPalette.ColorRole.Mid: "#2f3135",
        QPalette.ColorRole.Dark: "#18191c", QPalette.ColorRole.Shadow: "#000000",
        QPalette.ColorRole.Highlight: "#3d6fb4", QPalette.ColorRole.HighlightedText: "#ffffff",
        QPalette.ColorRole.Link: "#8ab4f8", QPalette.ColorRole.LinkVisited: "#c58af9",
    }
    for role, name in roles.items():
        palette.setColor(role, QColor(name))
    for role in (QPalette.ColorRole.WindowText, QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText):
        palette.setColor(QPalette.ColorGroup.Disabled, role, QColor("#6f7278"))
    return palette


def light_palette() -> QPalette:
    """Fusion's light palette: the same on every platform, whatever the system's scheme."""
    return QStyleFactory.create("Fusion").standardPalette()


class _Watcher(QObject):
    """Emits `changed` after the application's palette changed, whoever changed it."""

    changed = Signal()

    def eventFilter(self, obj, event) -> bool:
        if obj is QApplication.instance() and event.type() == QEvent.Type.ApplicationPaletteChange:
            self.changed.emit()
        return False


_watcher: _Watcher | None = None


def watcher() -> _Watcher:
    """The one object whose `changed` fires after each change of the application's palette."""
    global _watcher
    if _watcher is None:
        app = QApplication.instance()
        _watcher = _Watcher(app)
        app.installEventFilter(_watcher)
    return _watcher


class _Follower(QObject):
    """A widget's restyle, called after each palette change. A child of the widget: Qt ends its connection when the
    widget goes, so a widget freed (a chat switched away from) is never kept alive by it."""

    def __init__(self, widget, restyle):
        super().__init__(widget)
        self._restyle = restyle
        watcher().changed.connect(self.restyle)

    @Slot()
    def restyle(self) -> None:
        self._restyle()


def watch(widget, restyle) -> None:
    """Call `restyle()` now and after every palette change while `widget` lives."""
    restyle()
    _Follower(widget, restyle)


SETTINGS_KEY = "theme"


def stored(qsettings) -> str:
    """The theme kept in the settings ("system" when none, or an edited file's unknown one)."""
    value = qsettings.value(SETTINGS_KEY, "system")
    return value if value in THEMES else "system"


def choose(qsettings, theme: str) -> None:
    """The user chose `theme` (View ▸ Theme): applied now, kept for the next start."""
    apply(theme)
    qsettings.setValue(SETTINGS_KEY, theme)


def apply(theme: str) -> None:
    """Use `theme` ("system", "light" or "dark") for the whole application from now on."""
    if theme not in THEMES:
        raise ValueError(f"theme must be one of {', '.join(THEMES)}, not {theme!r}")
    app = QApplication.instance()
    watcher()
    hints = app.styleHints()
    if hasattr(hints, "setColorScheme"):  # Qt 6.8: title bars and native dialogs follow too
        hints.setColorScheme({"system": Qt.ColorScheme.Unknown, "light": Qt.ColorScheme.Light,
                              "dark": Qt.ColorScheme.Dark}[theme])
    # An empty palette hands the colours back to the platform, which follows the system's scheme.
    app.setPalette({"system": QPalette(), "light": light_palette(), "dark": dark_palette()}[theme])


def tint(label, role: str | None) -> None:
    """Colour `label`'s text with `colors().<role>` ("muted", "error", ...; None: the palette's own text colour), now
    and after every palette change."""
    label.setProperty("theme_role", role or "")
    label.setStyleSheet(f"color: {getattr(colors(), role)};" if role else "")
    if not label.property("theme_watched"):
        label.setProperty("theme_watched", True)
        watch(label, lambda: tint(label, label.property("theme_role") or None))
