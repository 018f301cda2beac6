"""Widgets that follow the theme are freed with the chat they showed, not kept until the next palette change."""

import gc

from PySide6.QtCore import QCoreApplication, QEvent


def _alive(type_name: str) -> int:
    return sum(1 for o in gc.get_objects() if type(o).__name__ == type_name)


def _settle(qtbot) -> None:
    """Let deleteLater's deletions happen, then collect what only Python still held."""
    qtbot.wait(1)
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
    gc.collect()


def test_switching_chats_frees_the_message_widgets_it_replaced(app_driver, tiny_model_dir, qtbot):
    # Caught: theme.watch() connected a closure holding each message's widgets to a global signal; nothing dropped it
    # before the next palette change, so every chat switch kept every message widget (review finding 10).
    from stowage.app import theme

    window = app_driver.open(tiny_model_dir)
    app_driver.wait_planned(window)  # the model's facts and plan said: no label is tinted for the first time later
    store = window.store
    chats = []
    for c in range(2):
        cid = store.create(f"chat {c}")
        for i in range(5):
            store.add_message(cid, "user", f"question {i} in chat {c}")
            store.add_message(cid, "assistant", f"**answer** {i} in chat {c}\n\n```python\nprint({i})\n```")
        chats.append(cid)
    window.conversations.refresh()
    receivers = lambda: theme.watcher().receivers("2changed()")  # noqa: E731

    def switch(times: int) -> None:
        for _ in range(times):
            for cid in chats:
                window.conversations.select(cid)  # as a click in the list does
        _settle(qtbot)

    switch(2)  # each chat shown twice: what is made once, lazily, is made
    assert window.chat.conversation_id == chats[-1] and len(window.chat.view.widgets) == 10
    widgets, views, followers = _alive("MessageWidget"), _alive("MarkdownView"), receivers()
    switch(4)
    # Eight more chats shown: 80 message widgets made and replaced; none of them stays alive.
    assert _alive("MessageWidget") == widgets
    assert _alive("MarkdownView") == views
    assert receivers() == followers
    # And what is on screen still follows the theme.
    first = window.chat.view.widgets[0]
    for name in ("dark", "light"):
        theme.apply(name)
        qtbot.waitUntil(lambda: theme.colors().user_background in first.styleSheet())
    theme.apply("system")
