"""gpt-oss's reply format ("harmony"): a reply is a run of messages, each on a channel, which a server shows apart.

A gpt-oss prompt ends with `<|start|>assistant`; the reply then reads, for example,

    <|channel|>analysis<|message|>The user asks ...<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>

`analysis` is the model's reasoning (OpenAI's API: `reasoning_content`), `final` the answer (`content`), and
`commentary` carries tool calls: the header names the recipient and the arguments' type,
`<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>` (the recipient
may stand after the role instead: `<|start|>assistant to=functions.x<|channel|>commentary json<|message|>`).
A message ends at `<|end|>`, the reply at `<|return|>` (after the final message) or `<|call|>` (after a tool call).

The text must be decoded with the special tokens kept (Tokenizer.decode(ids, skip_special_tokens=False)): the
markers are tokens. `parse` reads a whole reply; `HarmonyStream` reads one as it is generated and yields each
message's text as it grows, holding back only what could still become a marker.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
REASONING, FINAL, COMMENTARY = "analysis", "final", "commentary"
MARKER_RE = re.compile("|".join(re.escape(m) for m in MARKERS))
_RECIPIENT = re.compile(r"\bto=(\S+)")


@dataclass
class HarmonyMessage:
    """One message of a reply: its channel, its text, and for a tool call the recipient and the arguments' type."""

    channel: str | None = None  # "analysis", "commentary", "final"; None: the model wrote no channel
    content: str = ""
    recipient: str | None = None  # "functions.get_weather" for a tool call
    content_type: str | None = None  # "json" (`<|constrain|>json`, or a word after the channel)
    done: bool = False  # its end marker was seen (a reply cut short leaves the last one open)

    @property
    def is_tool_call(self) -> bool:
        return self.recipient is not None and self.recipient.startswith("functions.")


@dataclass
class HarmonyReply:
    """A parsed reply: its messages in order, and how it ended (`<|return|>`, `<|call|>`, or None: cut short)."""

    messages: list[HarmonyMessage] = field(default_factory=list)
    stop: str | None = None

    @property
    def reasoning(self) -> str:
        """The analysis channel's text, messages joined by a blank line."""
        return "\n\n".join(m.content for m in self.messages if m.channel == REASONING)

    @property
    def content(self) -> str:
        """What the user reads: the final channel's text (a reply without channels: all of its text)."""
        if all(m.channel is None for m in self.messages):
            return "".join(m.content for m in self.messages)
        return "\n\n".join(m.content for m in self.messages if m.channel == FINAL)

    @property
    def tool_calls(self) -> list[tuple[str, str]]:
        """(function name, arguments text) of each tool call, in order: `functions.get_weather` -> "get_weather"."""
        return [(m.recipient.removeprefix("functions."), m.content) for m in self.messages if m.is_tool_call]


def parse(text: str) -> HarmonyReply:
    """The reply `text` (special tokens kept), whole; text outside any message (a model off the format) is kept as a
    message without a channel, so nothing the model wrote is lost."""
    stream = HarmonyStream()
    stream.feed(text)
    stream.close()
    return stream.reply


@dataclass(frozen=True)
class Delta:
    """New text of the message at `index` of the reply (HarmonyStream.reply.messages), on its channel."""

    index: int
    channel: str | None
    text: str


class HarmonyStream:
    """A reply parsed as its text arrives: `feed(delta)` returns the Deltas of message text it completes."""

    def __init__(self):
        self.reply = HarmonyReply()
        self._buffer = ""
        self._header: str | None = ""  # the header text since <|start|> / <|channel|>; None: inside a message body
        self._message: HarmonyMessage | None = None

    def feed(self, text: str) -> list[Delta]:
        self._buffer += text
        out: list[Delta] = []
        while self._buffer:
            match = MARKER_RE.search(self._buffer)
            if match is None:
                keep = _partial_marker(self._buffer)  # a marker may be split between two deltas
                self._text(self._buffer[: len(self._buffer) - keep], out)
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            self._text(self._buffer[: match.start()], out)
            self._buffer = self._buffer[match.end() :]
            self._marker(match.group(), out)
        return out

    def close(self) -> list[Delta]:
        """The end of the reply: text held back as a possible marker is text after all."""
        out: list[Delta] = []
        self._text(self._buffer, out)
        self._buffer = ""
        return out

    def _text(self, text: str, out: list[Delta]) -> None:
        if not text:
            return
        if self._header is not None and self._message is not None:  # a header being read
            self._header += text
            return
        if self._message is None or self._message.done:  # text outside any message: keep it, channel unknown
            self._open(HarmonyMessage())
            self._header = None
        self._message.content += text
        out.append(Delta(len(self.reply.messages) - 1, self._message.channel, text))

    def _open(self, message: HarmonyMessage) -> None:
        self._message = message
        self.reply.messages.append(message)

    def _marker(self, marker: str, out: list[Delta]) -> None:
        if marker == START:  # a new message: its role and perhaps its recipient follow
            self._open(HarmonyMessage())
            self._header = ""
        elif marker in (CHANNEL, CONSTRAIN):
            if self._message is None or self._header is None:  # a reply opens on <|channel|> (after the prompt)
                self._open(HarmonyMessage())
                self._header = ""
            self._header += " " + marker
        elif marker == MESSAGE:
            if self._message is None or self._header is None:
                self._open(HarmonyMessage())
                self._header = ""
            self._read_header(self._message, self._header)
            self._header = None
        else:  # END, RETURN, CALL
            if self._message is not None:
                if self._header is not None:  # a header without a body
                    self._read_header(self._message, self._header)
                    self._header = None
                self._message.done = True
            if marker != END:
                self.reply.stop = marker

    @staticmethod
    def _read_header(message: HarmonyMessage, header: str) -> None:
        """`assistant to=functions.x <|channel|>commentary json` or `<|channel|>final <|constrain|>json`."""
        recipient = _RECIPIENT.search(header)
        if recipient:
            message.recipient = recipient.group(1)
        header = _RECIPIENT.sub("", header)
        before, _, constrain = header.partition(CONSTRAIN)
        _, has_channel, channel = before.partition(CHANNEL)
        words = channel.split()
        if has_channel and words:
            message.channel = words[0]
            if len(words) > 1:
                message.content_type = words[1]
        if constrain.split():
            message.content_type = constrain.split()[0]


def _partial_marker(text: str) -> int:
    """How many characters at the end of `text` could begin a marker (held back until the next delta)."""
    for n in range(min(len(text), max(map(len, MARKERS)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in MARKERS):
            return n
    return 0
