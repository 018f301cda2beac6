"""Train the bundled demo model (assets/demo-model/) from scripts/demo_dialogues.py, reproducibly.

    .venv/bin/python scripts/train_demo.py                 # tokenizer + model -> assets/demo-model
    .venv/bin/python scripts/train_demo.py --eval-only     # greedy replies of the saved model

A byte-level BPE tokenizer and a small LlamaForCausalLM (transformers) are trained on the CPU with one
thread and fixed seeds; the loss counts only the assistant's tokens, so the model learns to answer,
not to imitate the user. The folder it writes is the Hugging Face layout users download, so the demo
goes through the same loader, tokenizer and chat template as any other model.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_dialogues  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "assets" / "demo-model"

BOS, EOS, PAD = "<s>", "<|end|>", "<pad>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = [PAD, BOS, EOS] + [f"<|{role}|>" for role in ROLES]
# The same format the template below renders; training and chat must agree byte for byte.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

SEED = 1234
NUM_DIALOGUES = 6000
VOCAB_SIZE = 3072
MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=True)


def build_tokenizer(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS)
    # HF-style encode(text) prepends BOS; apply_chat_template encodes without special tokens, so the
    # template's own {{ bos_token }} is the only BOS in a chat prompt.
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]),
    ])
    return tok


def render(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The chat template in Python (the jinja version is checked against it in evaluate())."""
    text = BOS + "".join(f"<|{m['role']}|>\n{m['content']}{EOS}\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def encode_dialogue(tok: Tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of a rendered conversation and labels that keep only assistant replies (+ <|end|>)."""
    ids, labels = [tok.token_to_id(BOS)], [-100]
    for m in messages:
        head = tok.encode(f"<|{m['role']}|>\n", add_special_tokens=False).ids
        body = tok.encode(m["content"] + EOS, add_special_tokens=False).ids
        tail = tok.encode("\n", add_special_tokens=False).ids
        ids += head + body + tail
        learn = m["role"] == "assistant"
        labels += [-100] * len(head) + (body if learn else [-100] * len(body)) + [-100] * len(tail)
    # Pieces meet at special tokens or at the lone "\n" pre-token, so this equals encoding the whole text.
    assert ids == tok.encode(render(messages), add_special_tokens=False).ids
    return ids, labels


def batches(examples, batch_tokens: int, rng: random.Random):
    """Length-bucketed batches of about `batch_tokens` tokens each, in random order."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i][0]), rng.random()))
    groups, current = [], []
    for i in order:
        if current and (len(current) + 1) * len(examples[i][0]) > batch_tokens:
            groups.append(current)
            current = []
        current.append(i)
    groups.append(current)
    rng.shuffle(groups)
    for group in groups:
        width = max(len(examples[i][0]) for i in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        labels = torch.full((len(group), width), -100, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, i in enumerate(group):
            n = len(examples[i][0])
            ids[row, :n] = torch.tensor(examples[i][0])
            labels[row, :n] = torch.tensor(examples[i][1])
            mask[row, :n] = 1
        yield ids, labels, mask


def train(args) -> None:
    random.seed(SEED)
    torch.manual_seed(SEED)
    torch.set_num_threads(args.threads)
    from transformers import LlamaConfig, LlamaForCausalLM

    convs = demo_dialogues.dialogues(NUM_DIALOGUES, seed=SEED)
    tok = build_tokenizer([render(c) for c in convs])
    examples = [encode_dialogue(tok, c) for c in convs]
    vocab = math.ceil(tok.get_vocab_size() / 64) * 64
    num_tokens = sum(len(e[0]) for e in examples)
    print(f"tokenizer: {tok.get_vocab_size()} tokens (model vocab {vocab}); {len(examples)} dialogues, "
          f"{num_tokens} tokens", flush=True)

    config = LlamaConfig(vocab_size=vocab, bos_token_id=tok.token_to_id(BOS), eos_token_id=tok.token_to_id(EOS),
                         pad_token_id=tok.token_to_id(PAD), **MODEL)
    model = LlamaForCausalLM(config)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    rng = random.Random(SEED)
    steps_per_epoch = sum(1 for _ in batches(examples, args.batch_tokens, random.Random(0)))
    total = steps_per_epoch * args.epochs
    warmup = max(1, total // 30)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))))
    model.train()
    step, start = 0, time.time()
    for epoch in range(args.epochs):
        running = []
        for ids, labels, mask in batches(examples, args.batch_tokens, rng):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            schedule.step()
            running.append(loss.item())
            step += 1
            if step % 50 == 0:
                print(f"step {step}/{total} epoch {epoch} loss {sum(running[-50:]) / len(running[-50:]):.4f} "
                      f"lr {schedule.get_last_lr()[0]:.2e} {time.time() - start:.0f}s", flush=True)
        print(f"epoch {epoch} mean loss {sum(running) / len(running):.4f} {time.time() - start:.0f}s", flush=True)
    save(model, tok, config)
    print(f"trained in {time.time() - start:.0f}s; saved to {OUT_DIR}", flush=True)


def save(model, tok: Tokenizer, config) -> None:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(OUT_DIR, safe_serialization=True)
    tok.save(str(OUT_DIR / "tokenizer.json"))
    (OUT_DIR / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": True, "model_max_length": config.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")
    (OUT_DIR / "generation_config.json").write_text(json.dumps({
        "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id, "do_sample": False, "max_new_tokens": 256,
    }, indent=2) + "\n")


def evaluate(threads: int) -> float:
    """Greedy replies (transformers) to trained and held-out phrasings; returns the exact-match rate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(OUT_DIR)
    model = AutoModelForCausalLM.from_pretrained(OUT_DIR).eval()
    rng = random.Random(SEED + 1)
    cases = [(t.name, rng.choice(t.questions)) for t in demo_dialogues.TOPICS] + list(demo_dialogues.HELD_OUT)
    exact = 0
    for name, question in cases:
        messages = [{"role": "user", "content": question}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        assert tok.decode(ids["input_ids"][0]) == render(messages, add_generation_prompt=True)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=120, do_sample=False)
        reply = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        ok = reply == demo_dialogues.topic(name).answer
        exact += ok
        print(f"[{'ok' if ok else '--'}] {name}: {question!r}\n     -> {reply}", flush=True)
    print(f"exact answers: {exact}/{len(cases)}", flush=True)
    return exact / len(cases)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=1, help="1 leaves the other cores to everyone else")
    parser.add_argument("--eval-only", action="store_true")
    args = parser.parse_args()
    if not args.eval_only:
        train(args)
    evaluate(args.threads)


if __name__ == "__main__":
    main()
