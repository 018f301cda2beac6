"""Tiny random models of each supported architecture, written as Hugging Face would (offline)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

SPECIAL = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Stowage plans memory: weights, KV cache, workspace and headroom.",
    "Pick a context size with the slider; the bar shows what it costs.",
    "Überraschung! Café, naïve, 東京, emoji 🚀 and more bytes.",
] * 20


@lru_cache(maxsize=1)
def _tokenizer_object():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    return tok


def save_tokenizer(model_dir: Path, chat_template: str | None = TEMPLATE) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=_tokenizer_object(), bos_token="<s>", eos_token="<|end|>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(model_dir)


ARCHS = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "gemma2": "Gemma2Config",
    "gemma3_text": "Gemma3TextConfig",
}


def make_model(model_dir: Path, arch: str = "llama", *, dtype=torch.float32, seed: int = 0, **overrides) -> Path:
    """Save a tiny random model of `arch` (and a tokenizer) into model_dir; return model_dir."""
    import transformers

    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
        eos_token_id=_tokenizer_object().token_to_id("<|end|>"), bos_token_id=_tokenizer_object().token_to_id("<s>"),
    )
    if arch == "qwen3":
        kwargs["head_dim"] = 32
    kwargs.update(overrides)
    config = getattr(transformers, ARCHS[arch])(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so those paths are really tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(model_dir)
    save_tokenizer(model_dir)
    return model_dir


def cpu_plan(model_dir, context_tokens: int, **request):
    """A CPU-only plan for a test load (a roomy given budget, so it fits whatever the machine has free)."""
    from stowage.engine.planning import plan_for
    from stowage.engine.planning.budgets import given_budgets
    from stowage.engine.units import GiB

    return plan_for(model_dir, context_tokens, given_budgets([], 64 * GiB), **request)


def compare_logits_and_tokens(engine, reference, prompt: str, tolerance: float, *, max_tokens: int = 24,
                              generate: bool = True) -> None:
    """`engine`'s float32 logits of `prompt` within `tolerance` of transformers' (`reference`), then (`generate`) its
    greedy reply the same tokens. A reply keeps its conversation cached: call with generate=False before another."""
    from stowage.engine.runtime.kv_cache import Sequence
    from stowage.engine.runtime.sampler import SamplingParams

    ids = engine.tokenizer.encode(prompt)
    seq = Sequence()
    ours = engine.model.forward(ids, seq, engine.cache, all_logits=True)
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
    assert theirs.abs().max() > 1.0
    assert (ours - theirs).abs().max().item() <= tolerance, ((ours - theirs).abs().max().item(), theirs.abs().max().item())
    engine.cache.release(seq)
    if generate:
        result = engine.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens)).run()
        assert result.token_ids == greedy_reference(reference, ids, engine.eos_ids, max_tokens)


def edited_copy(model_dir: Path, out_dir: Path, edit_tensors=None, **config) -> Path:
    """A copy of `model_dir` in `out_dir` with `edit_tensors(dict)` applied to its model.safetensors and `config`
    merged into its config.json: a broken model for the typed-error tests."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir)
    if edit_tensors:
        tensors = load_file(out_dir / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, out_dir / "model.safetensors")
    if config:
        raw = json.loads((out_dir / "config.json").read_text())
        (out_dir / "config.json").write_text(json.dumps(raw | config))
    return out_dir


def refused(model_dir) -> str:
    """The ModelFormatError inspect (what `plan` reads, before any load) raises for `model_dir`, as text."""
    import pytest

    from stowage.engine.errors import ModelFormatError
    from stowage.engine.planning import inspect

    with pytest.raises(ModelFormatError) as e:
        inspect(model_dir)
    return str(e.value)


def greedy_reference(reference, ids, eos_ids, max_tokens):
    """transformers' greedy continuation of ids (a model from_pretrained), the eos tokens left out."""
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_tokens, do_sample=False, eos_token_id=sorted(eos_ids),
                                 pad_token_id=sorted(eos_ids)[0])
    return [t for t in out[0, len(ids):].tolist() if t not in eos_ids]


ROOT = Path(__file__).resolve().parents[2]


def run_fresh(code: str, *args: str, timeout: float = 600):
    """Run `code` in a fresh interpreter that imports the project and tests/support (for memory measurements)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "support"), str(ROOT / "bench")])}
    return subprocess.run([sys.executable, "-P", "-c", code, *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout)
