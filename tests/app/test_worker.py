"""The engine worker's answer to a chat: the engine's own GenerationResult, in a Reply that copies none of it."""

from __future__ import annotations

from stowage.app.replies import ChatRequest
from stowage.app.worker import EngineWorker
from stowage.engine.runtime.generation import GenerationResult, TokenEvent
from stowage.engine.runtime.sampler import SamplingParams


class FakeGeneration:
    def __init__(self, result: GenerationResult):
        self.result = result

    def __iter__(self):
        return iter([TokenEvent(5, "Hi"), TokenEvent(6, "!")])


class FakeEngine:
    """The in-process Engine's face towards the worker: chat() gives a Generation with its result."""

    def __init__(self, result: GenerationResult):
        self.result = result

    def chat(self, messages, sampling, *, cancel, progress):
        return FakeGeneration(self.result)


class FakeTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None):
        return [1, 2, 3]


def test_the_reply_is_the_engines_result(qtbot):
    result = GenerationResult(text="Hi!", token_ids=[5, 6], completion_tokens=2, finish_reason="stop",
                              prompt_tokens=3, decode_seconds=0.5)
    worker = EngineWorker(use_process=False)
    worker.engine, worker.tokenizer, worker.context_tokens = FakeEngine(result), FakeTokenizer(), 64
    with qtbot.waitSignal(worker.reply_finished) as finished:
        worker.chat(ChatRequest(1, [], [{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=4)))
    reply = finished.args[0]
    assert reply.conversation_id == 1
    assert reply.result is result  # the record the engine filled, not a copy of its fields
    assert reply.context_tokens == 5 and reply.result.decode_tokens_per_s == 2.0
