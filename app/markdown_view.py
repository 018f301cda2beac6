"""A message's Markdown, rendered: code blocks highlighted with a Copy button each, table headers aligned with
their columns, and plain text from Markdown for titles."""

from __future__ import annotations

from dataclasses import dataclass

from pygments import lex
from pygments.lexers import get_lexer_by_name
from pygments.styles import get_style_by_name
from pygments.util import ClassNotFound
from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import (
    QBrush,
    QColor,
    QFont,
    QGuiApplication,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
    QTextFormat,
    QTextOption,
    QTextTable,
)
from PySide6.QtWidgets import QFrame, QPushButton, QSizePolicy, QTextBrowser

from . import theme


@dataclass(frozen=True)
class CodeBlock:
    """A fenced code block as rendered: where it starts in the document, its language and its text."""

    position: int  # of its first character
    language: str
    code: str


class MarkdownView(QTextBrowser):
    """A read-only Markdown view as tall as its text, so the chat scrolls as one column."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setOpenExternalLinks(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setStyleSheet("background: transparent;")
        self.document().setDocumentMargin(2)
        self.setWordWrapMode(QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)
        self.markdown = ""
        self.code_blocks: list[CodeBlock] = []
        self.copy_buttons: list[QPushButton] = []
        theme.watch(self, lambda: self.set_markdown(self.markdown))

    def set_markdown(self, text: str) -> None:
        self.markdown = text
        document = self.document()
        # Models emit control bytes at times; Qt renders them as boxes, so they are dropped.
        document.setMarkdown(hard_breaks(_printable(text)))
        colors = theme.colors()
        align_table_headers(document)
        self.code_blocks = highlight_code(document, colors)
        self._place_copy_buttons()
        self._fit_height()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._fit_height()

    def _fit_height(self) -> None:
        self.document().setTextWidth(self.viewport().width())
        height = int(self.document().size().height()) + 4
        if height != self.height():
            self.setFixedHeight(height)
        self._move_copy_buttons()

    def sizeHint(self) -> QSize:
        return QSize(200, int(self.document().size().height()) + 4)

    # -- a Copy button at the top right of each code block --------------------------------------
    def _place_copy_buttons(self) -> None:
        while len(self.copy_buttons) > len(self.code_blocks):
            self.copy_buttons.pop().deleteLater()
        link = theme.colors().link
        while len(self.copy_buttons) < len(self.code_blocks):
            button = QPushButton("Copy", self.viewport())
            button.setToolTip("Copy this code")
            button.setCursor(Qt.CursorShape.PointingHandCursor)
            index = len(self.copy_buttons)
            button.clicked.connect(lambda _=False, i=index: self.copy_code(i))
            self.copy_buttons.append(button)
        for button in self.copy_buttons:
            button.setStyleSheet(f"QPushButton {{ color: {link}; border: none; background: transparent; "
                                 "padding: 0 4px; }")
            button.adjustSize()
            button.show()

    def _move_copy_buttons(self) -> None:
        layout = self.document().documentLayout()
        for block, button in zip(self.code_blocks, self.copy_buttons):
            rect = layout.blockBoundingRect(self.document().findBlock(block.position))
            button.move(max(0, self.viewport().width() - button.width() - 2), int(rect.top()))

    def copy_code(self, index: int) -> None:
        QGuiApplication.clipboard().setText(self.code_blocks[index].code)


def align_table_headers(document: QTextDocument) -> None:
    """Qt's Markdown leaves a table's header cells left-aligned over right- or centre-aligned columns: each header
    takes its column's alignment. (It also opens the first header cell with an empty line when a code block comes just
    before the table: that line goes.)"""
    for frame in document.rootFrame().childFrames():
        if not isinstance(frame, QTextTable) or frame.rows() < 2:
            continue
        for column in range(frame.columns()):
            cell = frame.cellAt(0, column)
            cursor = cell.firstCursorPosition()
            if not cursor.block().text() and cursor.block().position() + 1 < cell.lastPosition():
                cursor.deleteChar()  # the empty line's end: the header's text moves up into it, losing its bold
                cursor.setPosition(cell.lastPosition(), QTextCursor.MoveMode.KeepAnchor)
                bold = QTextCharFormat()
                bold.setFontWeight(QFont.Weight.Bold)
                cursor.mergeCharFormat(bold)
            alignment = frame.cellAt(1, column).firstCursorPosition().blockFormat().alignment()
            cursor = frame.cellAt(0, column).firstCursorPosition()
            block_format = cursor.blockFormat()
            block_format.setAlignment(alignment)
            cursor.setBlockFormat(block_format)


def highlight_code(document: QTextDocument, colors: theme.Colors) -> list[CodeBlock]:
    """Colour each fenced code block's tokens (Pygments, in the theme's style) on the theme's code background; the
    blocks, top to bottom."""
    style = get_style_by_name(colors.pygments_style)
    background = QBrush(QColor(colors.code_background))
    blocks: list[CodeBlock] = []
    block = document.begin()
    while block.isValid():
        if not block.blockFormat().hasProperty(QTextFormat.Property.BlockCodeFence):
            block = block.next()
            continue
        language = block.blockFormat().stringProperty(QTextFormat.Property.BlockCodeLanguage)
        start, lines = block.position(), []
        while block.isValid() and block.blockFormat().hasProperty(QTextFormat.Property.BlockCodeFence):
            cursor = QTextCursor(block)
            block_format = block.blockFormat()
            block_format.setBackground(background)
            cursor.setBlockFormat(block_format)
            lines.append(block.text())
            block = block.next()
        code = "\n".join(lines)
        _colour_tokens(document, start, code, language, style)
        blocks.append(CodeBlock(start, language, code))
    return blocks


def _colour_tokens(document: QTextDocument, start: int, code: str, language: str, style) -> None:
    try:
        lexer = get_lexer_by_name(language, stripnl=False, ensurenl=False) if language else None
    except ClassNotFound:
        lexer = None
    if lexer is None:  # no language named, or one Pygments does not know: monospace only
        return
    cursor = QTextCursor(document)
    offset = 0
    for token, text in lex(code, lexer):
        spec = style.style_for_token(token)
        if text and (spec["color"] or spec["bold"] or spec["italic"]):
            fmt = QTextCharFormat()
            if spec["color"]:
                fmt.setForeground(QColor(f"#{spec['color']}"))
            if spec["bold"]:
                fmt.setFontWeight(QFont.Weight.Bold)
            if spec["italic"]:
                fmt.setFontItalic(True)
            # each line is a block, and a block boundary is one position, as "\n" is one character of `code`
            cursor.setPosition(start + offset)
            cursor.setPosition(start + min(offset + len(text), len(code)), QTextCursor.MoveMode.KeepAnchor)
            cursor.mergeCharFormat(fmt)
        offset += len(text)


def plain_text(markdown: str) -> str:
    """The words of `markdown` without its marks (`**`, `#`, links' targets), on one line: for titles."""
    document = QTextDocument()
    document.setMarkdown(markdown)
    return " ".join(document.toPlainText().split())


def hard_breaks(text: str) -> str:
    """Keep every single line break (Markdown joins them into one line): two trailing spaces each, outside code fences.

    People and models both mean a new line when they write one (a poem, an address, a Shift+Enter message).
    """
    lines = text.split("\n")
    fence = ""  # the opening ``` or ~~~ while inside a fenced block
    for i, line in enumerate(lines[:-1]):
        stripped = line.lstrip()
        if fence:
            if stripped.startswith(fence):
                fence = ""
            continue
        if stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
            continue
        if stripped and lines[i + 1].strip():
            lines[i] = line + "  "
    return "\n".join(lines)


def _printable(text: str) -> str:
    return "".join(ch for ch in text if ch in "\n\t" or ch.isprintable())
