"""Ctrl-C in `stowage chat` stops the reply and the context line still counts what the context holds."""

import io
import re
import signal
import sys

from factory import make_model

from stowage.engine import cli


class InterruptedTerminal(io.StringIO):
    """stdout whose `after`-th write of the reply gets a real SIGINT, as a Ctrl-C mid-reply does."""

    def __init__(self, after: int):
        super().__init__()
        self.after = after

    def write(self, text: str) -> int:
        self.after -= 1
        if self.after == 0:
            signal.raise_signal(signal.SIGINT)  # the default handler raises KeyboardInterrupt here
        return super().write(text)


def test_ctrl_c_keeps_the_tokens_in_context(tmp_path, monkeypatch, capsys):
    model = make_model(tmp_path, "qwen2", initializer_range=0.2)
    monkeypatch.setattr(sys, "stdin", io.StringIO("tell me a long story\n"))
    terminal = InterruptedTerminal(after=5)
    monkeypatch.setattr(sys, "stdout", terminal)
    code = cli.main(["chat", str(model), "--max-tokens", "900", "--temperature", "0", "--context", "1024"])
    assert code == 0
    err = capsys.readouterr().err
    used = re.search(r"([\d,]+)/1,024 context\]", err)
    assert used is not None, err
    assert int(used.group(1).replace(",", "")) > 10  # the prompt and the tokens before Ctrl-C, not 0
