"""The engine's commands: `chat`, `generate`, `plan`, `serve`, `list`, and `search` / `pull` from the Hugging Face Hub
(stowage_entry.py sends `stowage` with no command to
the GUI).

`chat` and `generate` run the engine as the app does, in a child process (`stowage serve`, engine/process/engine_process.py):
a crash of the engine (a weights file truncated under it, the out-of-memory killer, a native fault) ends with
one line saying so and exit status 2, and the text printed so far stays. `chat --remote URL` is the same
conversation with any OpenAI-compatible server.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

from typing import TYPE_CHECKING

from stowage.kernels import cpu_decode

from ..formats.discovery import add_list_parser
from ..dtypes import COMPUTE_NAMES
from ..errors import InsufficientMemoryError, InvalidArgumentError, StowageError
from .hub import add_hub_parsers
from .plan import KV_DTYPE_HELP, _kv_dtype, add_plan_parser
from ..protocol import API_KEY_ENV, write_progress
from .serve import add_serve_parser

if TYPE_CHECKING:  # the sampler imports torch; the parser (`stowage --help`, `list`, `plan`) must not
    from ..runtime.sampling_params import SamplingParams


def _add_sampling(p: argparse.ArgumentParser, temperature: float) -> None:
    p.add_argument("--max-tokens", metavar="N", type=int, default=256,
                   help="the longest reply, in tokens (default 256)")
    p.add_argument("--temperature", metavar="T", type=float, default=temperature,
                   help=f"randomness of sampling; 0 is greedy, always the likeliest token (default {temperature})")
    p.add_argument("--top-k", metavar="K", type=int, default=0,
                   help="sample among the K likeliest tokens only (default 0: all)")
    p.add_argument("--top-p", metavar="P", type=float, default=1.0,
                   help="sample among the likeliest tokens whose probabilities add up to P (default 1.0: all)")
    p.add_argument("--min-p", metavar="P", type=float, default=0.0,
                   help="drop tokens less likely than P times the likeliest one (default 0.0: none)")
    p.add_argument("--repetition-penalty", metavar="X", type=float, default=1.0,
                   help="make tokens already in the text less likely; above 1 penalizes (default 1.0: off)")
    p.add_argument("--seed", metavar="N", type=int, default=None,
                   help="random seed, for replies that repeat (default: a new one each time)")
    p.add_argument("--stop", metavar="TEXT", action="append", default=[],
                   help="end the reply where TEXT appears (repeatable)")
    p.add_argument("--dtype", choices=sorted(COMPUTE_NAMES), default=None,
                   help="weights dtype (default: as stored, used in place)")
    p.add_argument("--kv-dtype", type=_kv_dtype, default=None, metavar="TYPE", help=KV_DTYPE_HELP)


def _sampling(args) -> SamplingParams:
    from ..runtime.sampling_params import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens, seed=args.seed,
                          stop=tuple(args.stop))


def _launch(args):
    """The engine in its child process, started before its plan request is known: its start (importing the engine)
    runs while this process counts the prompt's tokens. `_load` then sends the request; the child plans it first (a
    shortage is its one-line refusal, before anything is allocated)."""
    from ..process.engine_process import CAN_UNIX, EngineProcess

    # on a private Unix socket where there are such sockets (Linux, macOS), so no other user can reach it
    return EngineProcess.launch(args.model_dir, unix=CAN_UNIX)


def _load(engine, args, context_tokens: int):
    """Send the plan request and wait for the load; its progress goes to stderr so stdout stays the generated text
    (or the JSON) alone."""
    from ..plan_request import PlanRequest

    engine.send(PlanRequest(context_tokens, dtype=args.dtype, kv_dtype=args.kv_dtype))
    return engine.wait_ready(progress=write_progress)


def run_generate(args) -> int:
    from ..formats.source import read_tokenizer
    from ..text.tokenizer import check_text

    with _launch(args) as engine:
        sampling = _sampling(args)  # every argument is checked before anything is loaded
        check_text(args.prompt, "--prompt")
        response_format = _json_schema(args.json_schema) if args.json_schema else None
        tokenizer = read_tokenizer(args.model_dir)  # tokenizer.json, or GGUF metadata (built once, cached)
        messages = [{"role": "user", "content": args.prompt}]
        ids = tokenizer.apply_chat_template(messages) if args.chat else tokenizer.encode(args.prompt)
        if not ids:
            raise InvalidArgumentError("the prompt is empty (and the model adds no start token); give some text")
        _load(engine, args, len(ids) + args.max_tokens)
        stream = engine.complete(ids, sampling, response_format=response_format)  # the ids exactly as counted here
        for text in stream:
            if not args.json:
                sys.stdout.write(text)
                sys.stdout.flush()
    r = stream.result
    if args.json:
        print(json.dumps({
            "text": r.text, "token_ids": r.token_ids, "prompt_tokens": r.prompt_tokens,
            "finish_reason": r.finish_reason, "prefill_tokens_per_s": round(r.prefill_tokens_per_s, 2),
            "decode_tokens_per_s": round(r.decode_tokens_per_s, 2),
            # the reply parsed, under --json-schema once it is complete (null when max_tokens or a --stop string cut
            # it short)
            "value": _parsed(r.text) if response_format and r.finish_reason == "stop" else None,
        }, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    sys.stderr.write(f"{r.prompt_tokens} prompt tokens, {r.prefill_tokens_per_s:.1f} tok/s prefill; "
                     f"{r.completion_tokens} generated, {r.decode_tokens_per_s:.1f} tok/s decode ({r.finish_reason})\n")
    return 0


def _parsed(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _json_schema(path: str) -> dict:
    """--json-schema FILE as the request's response_format; InvalidArgumentError for a file or schema that will not
    do, before the model is loaded."""
    from ..text.grammar import json_schema_grammar

    try:
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InvalidArgumentError(f"--json-schema {path}: not a JSON file ({e})") from None
    json_schema_grammar(schema, f"--json-schema {path}")  # refused here, as the server would
    return {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}


def run_chat(args) -> int:
    sampling = _sampling(args)  # every argument is checked before anything is read or loaded
    if (args.model_dir is None) == (args.remote is None):
        raise InvalidArgumentError("give a MODEL to chat with, or --remote URL of a server, not both")
    if args.context_tokens is not None and args.context_tokens < 1:
        raise InvalidArgumentError(f"--context must be at least 1 token, got {args.context_tokens}")
    if args.system is not None:
        from ..text.tokenizer import check_text

        check_text(args.system, "--system")
    if args.remote is not None:
        return _chat_remote(args, sampling)
    with _launch(args) as engine:
        if args.context_tokens is None:
            from ..planning import default_context_tokens

            args.context_tokens = default_context_tokens(args.model_dir)
        _load(engine, args, args.context_tokens)
        return _converse(lambda messages: engine.chat(messages, sampling), Path(args.model_dir).name,
                         args.context_tokens, args.system, _prompt_counter(args.model_dir))


def _prompt_counter(model_dir):
    """Counts a conversation's prompt tokens as the engine does: a reply stopped with Ctrl-C never hears its count.
    The model is opened at the first count, not before the first prompt."""
    @functools.cache
    def tokenizer():
        from ..formats.source import open_source

        source = open_source(model_dir)
        source.tokenizer.use_builtin_template(source.config.model_type)  # as the engine does
        return source.tokenizer

    return lambda messages: len(tokenizer().apply_chat_template(messages))


def _chat_remote(args, sampling: SamplingParams) -> int:
    from ..process.client import RemoteServer

    server = RemoteServer(_server_url(args.remote), args.api_key or os.environ.get(API_KEY_ENV))
    models = server.models()
    if not models:
        raise InvalidArgumentError(f"{server.base_url} serves no model (GET /v1/models is empty)")
    model = next((m for m in models if m["id"] == args.model), None) if args.model else models[0]
    if model is None:
        raise InvalidArgumentError(f"{server.base_url} has no model {args.model!r}; it serves "
                                   + ", ".join(repr(m["id"]) for m in models))
    context_tokens = args.context_tokens or model.get("max_model_len")
    try:
        return _converse(lambda messages: server.chat(messages, sampling, model=model["id"]), model["id"],
                         context_tokens, args.system)
    finally:
        server.close()


def _server_url(text: str) -> str:
    """A server address as the app's server dialog takes it: http:// is added when no scheme is typed."""
    from ..process.client import UNIX_SCHEME

    text = text.strip()
    return text if "://" in text or text.startswith(UNIX_SCHEME) else "http://" + text


def _converse(reply, name: str, context_tokens: int | None, system_prompt: str | None, count=None) -> int:
    """The terminal conversation; reply(messages) is a stream of one reply (the server keeps what it cached)."""
    from ..text.tokenizer import check_text

    if hasattr(sys.stdin, "reconfigure"):  # undecodable input arrives as text the tokenizer refuses, not a crash
        sys.stdin.reconfigure(errors="surrogateescape")
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages = list(system)
    size = f"{context_tokens:,}-token context" if context_tokens else "context unknown"
    sys.stderr.write(f"Chatting with {name} ({size}). Ctrl-D to quit, Ctrl-C stops a reply.\n")
    while True:
        try:
            line = input("> ")
        except EOFError:
            sys.stderr.write("\n")
            return 0
        if not line.strip():
            continue
        try:
            check_text(line, "that line")
        except InvalidArgumentError as e:  # this line cannot be sent; the conversation goes on
            sys.stderr.write(f"[{e}]\n")
            continue
        messages.append({"role": "user", "content": line})
        try:
            try:
                r = _reply(reply(messages), count and (lambda: count(messages)))
            except InsufficientMemoryError as e:
                if len(messages) == len(system) + 1:
                    raise
                # The conversation outgrew the context: keep the session, start over from this message.
                sys.stderr.write(f"[the conversation is full ({e}); starting a new conversation with your "
                                 "last message]\n")
                messages = [*system, messages[-1]]
                r = _reply(reply(messages), count and (lambda: count(messages)))
        except InsufficientMemoryError as e:
            messages.pop()
            sys.stderr.write(f"[that message alone does not fit ({e}); send a shorter one]\n")
            continue
        except InvalidArgumentError as e:  # the server refused this message; the conversation goes on
            messages.pop()
            sys.stderr.write(f"[{e}]\n")
            continue
        messages.append({"role": "assistant", "content": r.text})
        used = f"{r.prompt_tokens + r.completion_tokens:,}" if r.prompt_tokens else "?"  # a remote reply stopped
        sys.stderr.write(f"[{r.reused_tokens} tokens reused, {r.prefilled_tokens} prefilled, "
                         f"{r.decode_tokens_per_s:.1f} tok/s, "
                         f"{used}/{f'{context_tokens:,}' if context_tokens else '?'} context]\n")


def _reply(stream, count_prompt=None):
    """Stream one reply to stdout; Ctrl-C stops it (closing the stream cancels it on the server). Its result; a
    stopped one has no usage from the server, so its tokens are counted here (the prompt with `count_prompt()`)."""
    texts = iter(stream)
    pieces = 0
    try:
        for text in texts:
            pieces += 1
            sys.stdout.write(text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        texts.close()
        r = stream.result
        r.finish_reason = "cancelled"
        if not r.prompt_tokens and count_prompt is not None:
            r.prompt_tokens, r.completion_tokens = count_prompt(), r.completion_tokens or pieces
    sys.stdout.write("\n")
    return stream.result


MODEL_HELP = "a model folder (config.json, *.safetensors) or a .gguf file"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("stowage")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


class _VersionAction(argparse.Action):
    """--version: the installed version, looked up only when asked (the package metadata is a slow import)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help or "show the version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(f"stowage {_version()}\n")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stowage", description="Run language models locally. "
                                     "With no command, opens the desktop app.")
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a reply to one prompt")
    gen.add_argument("model_dir", metavar="MODEL", help=MODEL_HELP)
    gen.add_argument("--prompt", metavar="TEXT", required=True, help="the prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--json-schema", metavar="FILE", default=None,
                     help="the reply is JSON valid under the JSON Schema in FILE (constrained decoding)")
    _add_sampling(gen, temperature=0.0)
    gen.set_defaults(func=run_generate)
    chat = sub.add_parser("chat", help="chat in the terminal, with a model or with a server (--remote)")
    chat.add_argument("model_dir", metavar="MODEL", nargs="?", default=None, help=MODEL_HELP + " (or --remote)")
    chat.add_argument("--remote", metavar="URL", default=None,
                      help="chat with the OpenAI-compatible server at URL (another stowage serve, vLLM, llama.cpp's "
                           "server, Ollama) instead of a local model")
    chat.add_argument("--model", metavar="NAME", default=None,
                      help="with --remote: the model to use (default: the first of GET /v1/models)")
    chat.add_argument("--api-key", metavar="KEY", default=None,
                      help=f"with --remote: the server's key (default: ${API_KEY_ENV})")
    chat.add_argument("--context", dest="context_tokens", metavar="N", type=int, default=None,
                      help="context size in tokens (default: 4096 or the model's maximum if smaller; with --remote "
                           "the server's, where it says)")
    chat.add_argument("--system", metavar="TEXT", default=None, help="system prompt")
    _add_sampling(chat, temperature=0.7)
    chat.set_defaults(func=run_chat)
    add_plan_parser(sub)
    serve = add_serve_parser(sub)
    add_list_parser(sub)
    add_hub_parsers(sub)
    for p in (gen, chat, serve):
        p.add_argument("--threads", metavar="N", type=int, default=None,
                       help="CPU threads (default: the cores this process may use; at most "
                            f"{cpu_decode.THREADS_PER_CORE}x those)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "threads", None) is not None:  # the engine (in this process or its child) reads it
            if args.threads < 1:
                raise InvalidArgumentError(f"--threads must be at least 1, got {args.threads}")
            if args.threads > cpu_decode.max_threads():
                cores = cpu_decode.num_cores()
                raise InvalidArgumentError(
                    f"--threads {args.threads:,} is more than {cpu_decode.THREADS_PER_CORE}x the {cores} cores this "
                    f"process may use; give at most {cpu_decode.max_threads()} (default: {cores})")
            os.environ[cpu_decode.THREADS_ENV] = str(args.threads)
        return args.func(args)
    except StowageError as e:
        sys.stderr.write(f"\nstowage: {e}\n")
        return 2
    except KeyboardInterrupt:  # Ctrl-C where a command has nothing of its own to say (a search, a header read)
        sys.stderr.write("\nstowage: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
