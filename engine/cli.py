"""The engine's commands: `chat`, `generate` and `plan` (stowage_entry.py sends `stowage` with no command to the GUI)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

from .defaults import DEFAULT_CONTEXT
from .dtypes import COMPUTE, KV
from .errors import InsufficientMemoryError, InvalidArgumentError, StowageError
from .planning.cli import add_plan_parser
from .server.cli import add_serve_parser
from .sampler import SamplingParams


def _progress(fraction: float, message: str) -> None:
    # Progress goes to stderr so stdout stays the generated text (or the JSON) alone.
    sys.stderr.write(f"\r\033[K[{fraction * 100:5.1f}%] {message}")
    if fraction >= 1.0:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _add_sampling(p: argparse.ArgumentParser, temperature: float) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=temperature, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", choices=sorted(COMPUTE), default=None,
                   help="weights dtype (default: as stored, used in place)")
    p.add_argument("--kv-dtype", choices=sorted(KV), default=None)


def _sampling(args) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens, seed=args.seed,
                          stop=tuple(args.stop))


def _load(args, context_tokens: int):
    from .engine import Engine
    from .planning import plan_for

    # Planned against this machine first: a shortage is an error before anything is allocated.
    plan = plan_for(args.model_dir, context_tokens, dtype=args.dtype, kv_dtype=args.kv_dtype)
    return Engine.load(args.model_dir, plan, progress=_progress)


def run_generate(args) -> int:
    from .formats import read_config, read_tokenizer
    from .tokenizer import check_text

    sampling = _sampling(args)  # every argument is checked before anything is read or loaded
    check_text(args.prompt, "--prompt")
    read_config(args.model_dir)  # the first thing to be wrong with a model is its config
    tokenizer = read_tokenizer(args.model_dir)  # tokenizer.json, or a GGUF file's metadata
    messages = [{"role": "user", "content": args.prompt}]
    ids = tokenizer.apply_chat_template(messages) if args.chat else tokenizer.encode(args.prompt)
    if not ids:
        raise InvalidArgumentError("the prompt is empty (and the model adds no start token); give some text")
    engine = _load(args, len(ids) + args.max_tokens)
    gen = engine.generate(engine.new_conversation(), ids, sampling)
    for event in gen:
        if not args.json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    r = gen.result
    if args.json:
        print(json.dumps({
            "text": r.text, "token_ids": r.token_ids, "prompt_tokens": r.prompt_tokens,
            "finish_reason": r.finish_reason, "prefill_tokens_per_s": round(r.prefill_tokens_per_s, 2),
            "decode_tokens_per_s": round(r.decode_tokens_per_s, 2),
        }, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    sys.stderr.write(f"{r.prompt_tokens} prompt tokens, {r.prefill_tokens_per_s:.1f} tok/s prefill; "
                     f"{len(r.token_ids)} generated, {r.decode_tokens_per_s:.1f} tok/s decode ({r.finish_reason})\n")
    return 0


def run_chat(args) -> int:
    sampling = _sampling(args)  # every argument is checked before anything is read or loaded
    if args.context is not None and args.context < 1:
        raise InvalidArgumentError(f"--context must be at least 1 token, got {args.context}")
    if args.system is not None:
        from .tokenizer import check_text

        check_text(args.system, "--system")
    if args.context is None:
        from .formats import read_config

        args.context = min(DEFAULT_CONTEXT, read_config(args.model_dir).max_position_embeddings)
    engine = _load(args, args.context)
    if hasattr(sys.stdin, "reconfigure"):  # undecodable input arrives as text the tokenizer refuses, not a crash
        sys.stdin.reconfigure(errors="surrogateescape")
    system = [{"role": "system", "content": args.system}] if args.system else []
    conv, messages = engine.new_conversation(), list(system)
    sys.stderr.write(f"Chatting with {engine.name} ({args.context:,}-token context). Ctrl-D to quit, "
                     "Ctrl-C stops a reply.\n")
    while True:
        try:
            line = input("> ")
        except EOFError:
            sys.stderr.write("\n")
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            try:
                r = _reply(engine, conv, messages, sampling)
            except InsufficientMemoryError as e:
                if len(messages) == len(system) + 1:
                    raise
                # The conversation outgrew the cache: keep the session, start over from this message.
                sys.stderr.write(f"[the conversation is full ({e}); starting a new conversation with your "
                                 "last message]\n")
                engine.release(conv)
                conv, messages = engine.new_conversation(), [*system, messages[-1]]
                r = _reply(engine, conv, messages, sampling)
        except InsufficientMemoryError as e:
            messages.pop()
            sys.stderr.write(f"[that message alone does not fit ({e}); send a shorter one]\n")
            continue
        except InvalidArgumentError as e:  # this line cannot be sent (not UTF-8); the conversation goes on
            messages.pop()
            sys.stderr.write(f"[{e}]\n")
            continue
        messages.append({"role": "assistant", "content": r.text})
        sys.stderr.write(f"[{r.reused_tokens} tokens reused, {r.prefilled_tokens} prefilled, "
                         f"{r.decode_tokens_per_s:.1f} tok/s, {conv.num_tokens:,}/{args.context:,} context]\n")


def _reply(engine, conv, messages: list[dict], sampling: SamplingParams):
    """Stream one reply to stdout; Ctrl-C stops it. Returns the GenerationResult."""
    cancel = threading.Event()
    gen = engine.chat(conv, messages, sampling, cancel=cancel)
    try:
        for event in gen:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        cancel.set()
    sys.stdout.write("\n")
    return gen.result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stowage", description="Run language models locally. "
                                     "With no command, opens the desktop app.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a reply to one prompt")
    gen.add_argument("model_dir")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    _add_sampling(gen, temperature=0.0)
    gen.set_defaults(func=run_generate)
    chat = sub.add_parser("chat", help="chat in the terminal")
    chat.add_argument("model_dir")
    chat.add_argument("--context", type=int, default=None,
                      help="context size in tokens (default: 4096 or the model's maximum if smaller)")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_sampling(chat, temperature=0.7)
    chat.set_defaults(func=run_chat)
    add_plan_parser(sub)
    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except StowageError as e:
        sys.stderr.write(f"\nstowage: {e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
