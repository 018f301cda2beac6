"""The left side's conversation: messages, the input box, Send / Stop / Regenerate, speed and context use."""

from __future__ import annotations

import time
from dataclasses import asdict, replace

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from . import context_policy, theme, tool_messages
from .chat_controls import ChatControls
from .chat_input import ChatInput
from .chat_notice import ChatNotice
from .chat_presets import ChatPresets
from .chat_view import ChatView
from .markdown_view import plain_text
from .model_settings import DEFAULT_SAMPLING, ModelSettings
from .prompt_progress import PromptProgress
from .reply_options import ReplyOptions
from .store import ConversationStore, Message
from .system_prompt_bar import SystemPromptBar
from .replies import ChatRequest, Reply, ReplyStarted
from .streaming_reply import StreamingReply
from .worker import EngineClient

TITLE_CHARS = 40
HINT_NO_MODEL = "Pick a model on the right, press Load, then type a message below."
HINT_READY = "Type a message below: Enter sends it, Shift+Enter starts a new line."
NEW_CHAT = "New chat with this system prompt"
DROP_OLDEST = "Drop the oldest turns and resend"
# A regenerated reply at temperature 0 is the same word for word; this one is Stowage's usual temperature.
RETRY_TEMPERATURE = DEFAULT_SAMPLING.temperature
RETRY = f"Regenerate at temperature {RETRY_TEMPERATURE}"
USE_COMPLETION = "Use completion mode"
HINT_COMPLETION = "Completion mode: type the start of a text, and the model continues it as written."


class ChatPanel(QWidget):
    """Sends the current conversation to the engine and stores every message, a reply as it streams."""

    conversation_created = Signal(int)
    conversation_renamed = Signal(int)
    reply_done = Signal(object)  # Reply, after it is stored and shown

    def __init__(self, store: ConversationStore, client: EngineClient, parent=None):
        super().__init__(parent)
        self.store = store
        self.client = client
        self.settings = ModelSettings()
        self.conversation_id: int | None = None
        self.context_tokens = 0  # of the loaded model; 0 while none is loaded
        self.model_name = ""  # of the loaded model, kept with each reply
        self._reply: StreamingReply | None = None  # the reply streaming now, whichever chat is on screen
        self._greedy_retry = False  # the streaming reply is a greedy one written again: the same text
        self._outgrown: int | None = None  # the chat whose failure, next, is its conversation outgrowing the context

        self.system_prompt = SystemPromptBar()
        self.presets = ChatPresets(store, self.system_prompt)
        self.view = ChatView()
        self.input = ChatInput()
        self.controls = c = ChatControls()
        # by name, as tests and the screenshot drivers reach them
        self.send_button, self.stop_button, self.regenerate_button = c.send_button, c.stop_button, c.regenerate_button
        self.completion_button, self.reply_options, self.counter = c.completion_button, c.reply_options, c.counter
        self.error = QLabel()
        self.error.setWordWrap(True)
        theme.tint(self.error, "error")
        self.error.hide()
        self.prompt_progress = PromptProgress()
        self.notice = ChatNotice()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.system_prompt)
        layout.addWidget(self.view, 1)
        layout.addWidget(self.prompt_progress)
        layout.addWidget(self.error)
        layout.addWidget(self.notice)
        layout.addWidget(self.input)
        layout.addWidget(self.controls)

        self.input.submitted.connect(self.send)
        self.send_button.clicked.connect(self.send)
        self.stop_button.clicked.connect(self.client.stop)
        self.regenerate_button.clicked.connect(lambda: self.regenerate())
        self.completion_button.toggled.connect(self._completion_toggled)
        self.reply_options.changed.connect(self._reply_options_changed)
        self.view.edit_submitted.connect(self.edit_and_resend)
        self.view.alternative_chosen.connect(self.choose_alternative)
        self.view.delete_requested.connect(self.delete_message)
        self.system_prompt.changed.connect(self._system_prompt_changed)
        self.system_prompt.preset_chosen.connect(self.choose_preset)
        self.system_prompt.preset_saved.connect(self.save_preset)
        self.system_prompt.preset_deleted.connect(self.delete_preset)
        worker = self.client.worker
        worker.reply_started.connect(self._reply_started)
        worker.token.connect(self._token)
        worker.reply_finished.connect(self._reply_finished)
        worker.reply_failed.connect(self._reply_failed)
        worker.conversation_full.connect(self._conversation_full)
        worker.tool_calls.connect(self._tool_calls)
        worker.prefill_progress.connect(self._prefill_progress)
        self.view.set_placeholder(HINT_NO_MODEL)
        self._update_buttons()

    # -- which conversation ---------------------------------------------------------------------
    def show_conversation(self, conversation_id: int | None) -> None:
        self.conversation_id = conversation_id if conversation_id is not None and conversation_id >= 0 else None
        self.error.hide()
        self.notice.clear()
        self.prompt_progress.hide()  # the streaming chat's shows again at its next chunk
        if self.conversation_id is None:
            self.view.set_messages([])
            self.presets.show(None)
            self.reply_options.set_options(ReplyOptions())
        else:
            row = self.store.conversation(self.conversation_id)
            self.presets.show(row)
            self.reply_options.set_options(ReplyOptions.from_dict(row.reply_options))
            streaming = self._streaming_for(self.conversation_id)
            messages = [m for m in self.store.messages(self.conversation_id) if not (streaming and m.id == self._reply.id)]
            self.view.set_messages(messages, row.memory_start_id)
            if streaming:  # the reply so far, then the rest as it arrives
                self.view.begin_reply()
                self.view.append_reply(self._reply.text)
        self.counter.setText(self._context_text(None))
        self._show_pending_call()
        self._update_buttons()

    def conversation_deleted(self, conversation_id: int) -> None:
        """A reply for a deleted conversation has no one to read it: stop it (its end re-enables Send). Its K/V needs
        nothing: the engine keeps chats' K/V by their tokens and evicts the least recently used when it needs room."""
        if self._streaming_for(conversation_id):
            self._reply.orphaned = True
            self.client.stop()
        if conversation_id == self.conversation_id:
            self.show_conversation(None)  # until the list shows the next one

    @property
    def is_replying(self) -> bool:
        """A reply is under way: asked of the engine, or its end not yet taken in here. The client's own flag clears on
        the same finishing signal, in an event of its own that can come first: a message sent between the two would
        have taken the old reply's end as its own."""
        return self.client.is_generating or self._reply is not None

    def _streaming_for(self, conversation_id: int | None) -> bool:
        """Whether a reply streams now for this chat."""
        return self.client.is_generating and self._reply is not None and self._reply.conversation_id == conversation_id

    def set_settings(self, settings: ModelSettings) -> None:
        """The settings panel's choices: sampling, and the default system prompt for chats without their own."""
        self.settings = self.presets.settings = settings
        self.presets.refresh(self.system_prompt.own)
        self._update_buttons()  # the Regenerate hint follows the temperature

    def _chat_id(self) -> int:
        """The chat on screen, made now if none is (a new chat is stored at its first choice or message)."""
        if self.conversation_id is None:
            self.conversation_id = self.store.create()
            self.conversation_created.emit(self.conversation_id)
        return self.conversation_id

    def _system_prompt_changed(self, own: str | None) -> None:
        self.store.set_system_prompt(self._chat_id(), own)
        self.presets.refresh(own)

    def _reply_options_changed(self, options: ReplyOptions) -> None:
        self.store.set_reply_options(self._chat_id(), options.to_dict())

    def _pending_call(self) -> dict | None:
        """The tool call of this chat's last reply that waits for its result."""
        if self.conversation_id is None:
            return None
        return tool_messages.pending_call(self.store.messages(self.conversation_id))

    def _show_pending_call(self) -> None:
        """While a call waits for its result, the message box asks for it."""
        call = self._pending_call()
        name = call["function"].get("name", "?") if call is not None else ""
        self.input.setPlaceholderText(f"The result of {name} (run it yourself): Enter sends it to the model"
                                      if call is not None else ChatInput.PLACEHOLDER)
        self.input.viewport().update()  # a placeholder changed on an empty box is not repainted by itself

    # -- presets: a system prompt with sampling, by name, chosen per chat (chat_presets.py) --------
    def choose_preset(self, preset_id: int | None) -> None:
        self.presets.choose(self._chat_id(), preset_id)

    def save_preset(self, name: str) -> int:
        return self.presets.save(self._chat_id(), name)

    def delete_preset(self, preset_id: int) -> None:
        self.presets.delete(preset_id)

    def set_model_loaded(self, context_tokens: int, model_name: str = "") -> None:
        self.context_tokens = context_tokens
        self.model_name = model_name
        if context_tokens:
            self.error.hide()  # what it said was about the model before (or none): it no longer holds
        # A model loaded here without a chat template of its own (or a built-in one) is a base model.
        tokenizer = getattr(self.client.worker, "tokenizer", None) if context_tokens else None
        is_base = tokenizer is not None and getattr(tokenizer, "chat_template", "") is None
        self.completion_button.setChecked(False)
        self.completion_button.setVisible(is_base)
        if is_base:
            self.notice.show_notice(
                "base", f"{model_name or 'This model'} is a base model: it has no chat template and was not trained to "
                "answer chat messages, so chat replies are formatted as plain 'User: … Assistant: …' text and may "
                "ramble. Completion mode continues your text as written instead.",
                [(USE_COMPLETION, lambda: self.completion_button.setChecked(True))])
        elif self.notice.kind == "base":
            self.notice.clear()
        self.view.set_placeholder(HINT_READY if context_tokens else HINT_NO_MODEL)
        self.counter.setText(self._context_text(None))
        self._update_buttons()

    def _completion_toggled(self, on: bool) -> None:
        if on and self.notice.kind == "base":
            self.notice.clear()
        if self.context_tokens:
            self.view.set_placeholder(HINT_COMPLETION if on else HINT_READY)

    # -- sending --------------------------------------------------------------------------------
    def send(self) -> None:
        text = self.input.toPlainText().strip()
        if not text or self.is_replying:
            return
        if not self.context_tokens:
            self.show_error("No model is loaded yet: choose one on the right and press Load. Your message is kept.")
            return
        row = self.store.conversation(self._chat_id())
        if row.title == "New chat":
            title = plain_text(text) or " ".join(text.split())  # the words, not the Markdown's marks
            self.store.rename(self.conversation_id, title[:TITLE_CHARS] + ("…" if len(title) > TITLE_CHARS else ""))
            self.conversation_renamed.emit(self.conversation_id)
        call = self._pending_call()
        role, meta = ("user", {}) if call is None else (
            "tool", {"tool_call_id": call.get("id", ""), "name": call["function"].get("name", "")})
        message_id = self.store.add_message(self.conversation_id, role, text, meta)
        # Cleared only once the message is safely stored: nothing typed is ever lost.
        self.input.clear()
        self.view.add_message(Message(message_id, role, text, meta, parent_id=None, siblings=(message_id,)))
        self._show_pending_call()
        if self._pending_call() is None:  # a reply's calls all answered: the model goes on
            self._start_reply(self.store.messages(self.conversation_id))

    def regenerate(self, temperature: float | None = None) -> None:
        """Write the last reply again, beside the old one (after a Stop, an error, or a reply you did not like);
        at `temperature` this once, when given."""
        if self.conversation_id is None or self.is_replying or not self.context_tokens:
            return
        messages = self.store.messages(self.conversation_id)
        last_question = max((i for i, m in enumerate(messages) if m.role in ("user", "tool")), default=None)
        if last_question is None:
            return
        kept = messages[: last_question + 1]
        self.error.hide()
        self.view.set_messages(kept, self.store.conversation(self.conversation_id).memory_start_id)
        sampling = self.presets.sampling()
        if temperature is not None:  # a new seed too: a fixed one would repeat this reply as well
            sampling = replace(sampling, temperature=temperature, seed=None)
        self._start_reply(kept, sampling)
        self._greedy_retry = sampling.temperature == 0

    def edit_and_resend(self, message_id: int, text: str) -> None:
        """Send an edited message as a new version of it; the old one stays with the branch below it."""
        if self.conversation_id is None or self.is_replying:
            return
        if not self.context_tokens:
            self.show_error("No model is loaded yet: load one, then edit the message again.")
            return
        self.store.add_alternative(message_id, text)
        self.show_conversation(self.conversation_id)
        self._start_reply(self.store.messages(self.conversation_id))

    def delete_message(self, message_id: int) -> None:
        """Delete one message from the chat and its file (the messages after it stay)."""
        if self.conversation_id is None or self.is_replying:
            return
        self.store.delete_message(message_id)
        self.show_conversation(self.conversation_id)

    def new_chat_like_this(self) -> None:
        """A new chat with this one's system prompt, preset and reply options; the last message waits in the input
        box."""
        if self.conversation_id is None or self.is_replying:
            return
        row = self.store.conversation(self.conversation_id)
        last = next((m.content for m in reversed(self.store.messages(row.id)) if m.role == "user"), "")
        new = self.store.create()
        self.store.set_system_prompt(new, row.system_prompt)
        self.store.set_preset(new, row.preset_id)
        self.store.set_reply_options(new, row.reply_options)
        self.conversation_id = new
        self.conversation_created.emit(new)
        self.show_conversation(new)
        if not self.input.toPlainText().strip():
            self.input.setPlainText(last)
        self.input.setFocus()

    def drop_oldest_and_resend(self) -> None:
        """From now on this chat forgets its oldest turns when full; its last message is answered again."""
        if self.conversation_id is None or self.is_replying:
            return
        self.store.set_overflow_policy(self.conversation_id, context_policy.DROP_OLDEST)
        messages = self.store.messages(self.conversation_id)
        while messages and messages[-1].role not in ("user", "tool"):
            messages.pop()
        if messages:
            self.view.set_messages(messages, self.store.conversation(self.conversation_id).memory_start_id)
            self._start_reply(messages)

    def _offer_ways_on(self, kind: str) -> None:
        """The chat is full: offer a new chat carrying its system prompt, or forgetting its oldest turns."""
        actions = [(NEW_CHAT, self.new_chat_like_this)]
        if self._policy() == context_policy.STOP:
            actions.append((DROP_OLDEST, self.drop_oldest_and_resend))
        self.notice.show_notice(kind, "This chat's context is full. To go on:", actions)

    def _policy(self) -> str:
        """What this chat does when its context is full: its own choice, else the settings'."""
        row = self.store.conversation(self.conversation_id) if self.conversation_id is not None else None
        return (row.overflow_policy if row is not None else None) or self.settings.overflow_policy

    def choose_alternative(self, message_id: int) -> None:
        """‹ ›: show another version of a message, with the branch below it as it was last shown."""
        if self.conversation_id is None or self.is_replying:
            return
        self.store.choose(message_id)
        self.show_conversation(self.conversation_id)

    def _start_reply(self, messages: list[Message], sampling=None) -> None:
        """Ask for a reply to `messages` (the branch on screen, up to the message answered), with `sampling` (None:
        the chat's)."""
        self.error.hide()
        self.notice.clear()
        request = ChatRequest(
            conversation_id=self.conversation_id,
            system=replace(self.settings, system_prompt=self.system_prompt.prompt).system_messages(),
            messages=[tool_messages.api_message(m) for m in messages],
            sampling=sampling or self.presets.sampling(),
            policy=self._policy(),
            completion=self.completion_button.isChecked(),
            options=self.reply_options.options,
        )
        self._reply = StreamingReply(self.store, self.conversation_id, [m.id for m in messages],
                                     asdict(request.sampling), self.model_name)
        self._greedy_retry = False
        self.view.begin_reply()
        self.client.chat(request)
        self._update_buttons()

    # -- worker signals -------------------------------------------------------------------------
    def _reply_started(self, started: ReplyStarted) -> None:
        reply = self._reply
        memory_start = reply.message_ids[started.first_kept] if started.first_kept else None
        try:
            changed = self.store.conversation(started.conversation_id).memory_start_id != memory_start
        except KeyError:  # deleted while the prompt was being prepared
            changed = False
        if changed:  # a write is a commit, slow on a busy disk: only when the line moves
            self.store.set_memory_start(started.conversation_id, memory_start)
        reply.prompt_tokens = started.prompt_tokens
        reply.started_at = time.perf_counter()
        reply.kept_head = started.kept_head if memory_start is not None else 0
        self.prompt_progress.begin()
        if started.conversation_id == self.conversation_id:
            self.view.mark_memory_start(memory_start, reply.kept_head)
            self.counter.setText(self._context_text(started.prompt_tokens))  # while the prompt is read

    def _prefill_progress(self, conversation_id: int, done: int, total: int) -> None:
        if conversation_id == self.conversation_id and self._streaming_for(conversation_id):
            self.prompt_progress.show_progress(done, total)

    def _token(self, conversation_id: int, text: str) -> None:
        reply = self._reply
        if reply.num_tokens == 0:
            self.prompt_progress.finish()
        reply.add(text)
        if conversation_id != self.conversation_id:
            return
        self.view.append_reply(text)
        seconds = time.perf_counter() - reply.started_at
        speed = reply.num_tokens / seconds if seconds > 0 else 0.0
        self.counter.setText(f"{speed:.1f} tokens/s · " + self._context_text(reply.prompt_tokens + reply.num_tokens))

    def _tool_calls(self, conversation_id: int, calls: list[dict]) -> None:
        if conversation_id == self.conversation_id and self._streaming_for(conversation_id):
            self.view.show_reply_calls(calls)

    def _reply_finished(self, reply: Reply) -> None:
        r = reply.result
        message, used = self._reply.end(r)
        self._reply = None
        self.prompt_progress.finish()
        if reply.conversation_id == self.conversation_id:
            if message is None:  # the branch as it was (a regenerated reply stopped early: the old one again)
                self.show_conversation(self.conversation_id)
            else:
                self.view.end_reply(message)
            speed = f"{r.decode_tokens_per_s:.1f} tokens/s · " if r.decode_tokens_per_s else ""
            self.counter.setText(speed + self._context_text(used))
            if r.finish_reason == "context_full":
                self.show_error(context_policy.context_full_text(self.context_tokens, self._policy()))
                self._offer_ways_on("overflow")
            elif r.tool_calls:
                self._show_pending_call()
            elif self._greedy_retry and message is not None:
                self.notice.show_notice(
                    "repeat", "At temperature 0 the model picks its likeliest word each time, so a regenerated reply "
                    "is the same word for word.", [(RETRY, lambda: self.regenerate(RETRY_TEMPERATURE))])
        self._update_buttons()
        self.reply_done.emit(reply)

    def _conversation_full(self, conversation_id: int) -> None:
        self._outgrown = conversation_id

    def _reply_failed(self, conversation_id: int, message: str) -> None:
        # What streamed before the error is kept, marked as cut short by it.
        outgrown, self._outgrown = self._outgrown == conversation_id, None
        streamed = self._reply
        stored = streamed.finish(streamed.text,
                                 streamed.meta("error", error=message, prompt_tokens=streamed.prompt_tokens))
        self._reply = None
        self.prompt_progress.finish()
        if conversation_id == self.conversation_id:
            if stored is None:
                self.show_conversation(self.conversation_id)
            else:
                self.view.end_reply(stored)
            self.show_error(message)
            if outgrown:
                self._offer_ways_on("overflow")
        self._update_buttons()

    def show_error(self, message: str) -> None:
        self.error.setText(message)
        self.error.show()

    def _context_text(self, used: int | None) -> str:
        if not self.context_tokens:
            return "No model loaded"
        if used is None:
            messages = self.store.messages(self.conversation_id) if self.conversation_id is not None else []
            metas = [m.meta for m in messages if m.meta.get("prompt_tokens")]
            used = metas[-1]["prompt_tokens"] + metas[-1].get("completion_tokens", 0) if metas else 0
        # A reply that fills the context counts its last token, which never entered the cache.
        return f"{min(used, self.context_tokens):,} / {self.context_tokens:,} tokens"

    def _update_buttons(self) -> None:
        generating = self.is_replying
        self.view.set_alternatives_enabled(not generating)
        has_question = any(w.message.role == "user" for w in self.view.widgets)
        self.controls.set_generating(generating, can_regenerate=bool(self.context_tokens) and has_question,
                                     greedy=self.presets.sampling().temperature == 0)
