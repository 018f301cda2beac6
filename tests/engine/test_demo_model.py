"""The bundled demo model loads through Stowage's own engine and answers on topic.

A broken loader, tokenizer or chat template turns its memorised answers into noise, so checking a
few words of a greedy reply catches them end to end.
"""

import json
from pathlib import Path

import pytest
import torch

from stowage.engine.runtime.engine import Engine
from factory import cpu_plan
from stowage.engine.runtime.sampler import SamplingParams

DEMO_MODEL_DIR = Path(__file__).resolve().parents[2] / "assets" / "demo-model"
# (question, words the reply must contain). The first phrasing is trained on; the second is not.
QUESTIONS = [
    ("How do I pick a context size?", ("slider", "KV cache", "memory")),
    ("My model is too big and does not fit, what can I do?", ("Lower the context", "fp8", "GPU")),
]


@pytest.fixture(scope="module")
def engine():
    engine = Engine.load(DEMO_MODEL_DIR, cpu_plan(DEMO_MODEL_DIR, 512))
    yield engine
    engine.close()


def greedy_reply(engine, question: str, max_tokens: int = 96):
    gen = engine.chat([{"role": "user", "content": question}], SamplingParams(temperature=0, max_tokens=max_tokens))
    text = "".join(event.text for event in gen)
    assert text == gen.result.text  # the streamed deltas add up to the result
    return gen.result


def test_folder_is_a_small_llama_in_hugging_face_layout():
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["max_position_embeddings"] >= 2048
    total = sum(p.stat().st_size for p in DEMO_MODEL_DIR.iterdir())
    assert total <= 30 * 2**20, f"the demo model is {total / 2**20:.1f} MiB; the budget is 30 MiB"
    tokenizer_config = json.loads((DEMO_MODEL_DIR / "tokenizer_config.json").read_text())
    assert "<|assistant|>" in tokenizer_config["chat_template"]


def test_chat_prompt_has_one_bos_and_ends_with_the_assistant_marker(engine):
    tok = engine.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    bos = tok.token_id(tok.bos_token)
    assert ids[0] == bos and ids.count(bos) == 1
    assert tok.decode(ids, skip_special_tokens=False) == "<s><|user|>\nhello<|end|>\n<|assistant|>\n"
    assert tok.encode("hello")[0] == bos  # plain encoding adds BOS, as transformers does


@pytest.mark.parametrize("question,expected", QUESTIONS)
def test_greedy_reply_is_on_topic_and_ends_at_end_token(engine, question, expected):
    result = greedy_reply(engine, question)
    for word in expected:
        assert word in result.text, f"reply to {question!r} lacks {word!r}: {result.text!r}"
    assert result.finish_reason == "stop"  # it ended with <|end|>, not at max_tokens


def test_engine_and_transformers_give_the_same_greedy_reply(engine):
    transformers = pytest.importorskip("transformers")
    question = QUESTIONS[0][0]
    ours = greedy_reply(engine, question)
    reference = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    assert prompt["input_ids"][0].tolist() == engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    with torch.no_grad():
        out = reference.generate(**prompt, max_new_tokens=96, do_sample=False)
    theirs = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert ours.text == theirs
