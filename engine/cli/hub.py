"""`stowage search TEXT` and `stowage pull REPO [--file NAME | --quant Q]`: models from the Hugging Face Hub
(engine/hub), downloaded into its cache with a progress bar on stderr; what `stowage plan REPO[:FILE]` asks of it."""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

from ..units import format_bytes, format_duration

# owner/name, or owner/name:file (a file of the repository), as `stowage plan` and `pull` take them
REPO_ARGUMENT = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<file>.+))?$")
BAR_WIDTH = 24


def is_remote(argument: str) -> bool:
    """An argument that names a repository (owner/name[:file]) and no local path."""
    return not Path(argument).exists() and REPO_ARGUMENT.match(argument) is not None


def add_hub_parsers(subparsers) -> None:
    search = subparsers.add_parser(
        "search", help="search the Hugging Face Hub for models Stowage runs (GGUF or safetensors)",
        description="Search the Hugging Face Hub (HF_ENDPOINT) for repositories with GGUF or safetensors weights of "
                    "an architecture Stowage runs, most downloaded first.")
    search.add_argument("text", metavar="TEXT", help="words in the repository's name, e.g. 'qwen3 gguf'")
    search.add_argument("--limit", metavar="N", type=int, default=20, help="at most N results (default 20)")
    search.set_defaults(func=run_search)
    pull = subparsers.add_parser(
        "pull", help="download a model from the Hugging Face Hub into its cache",
        description="Download a model of REPO (owner/name) into the Hugging Face cache, where `stowage list` and the "
                    "app find it. With several models in the repository, choose one with --file or --quant; "
                    "`stowage plan REPO` shows whether each fits first. An interrupted download resumes.")
    pull.add_argument("repo", metavar="REPO", help="the repository, owner/name (or owner/name:FILE)")
    which = pull.add_mutually_exclusive_group()
    which.add_argument("--file", metavar="NAME", help="the file to download (any part of a split GGUF)")
    which.add_argument("--quant", metavar="Q", help="the quantization to download, e.g. Q4_K_M")
    pull.add_argument("--revision", metavar="REV", default=None, help="branch, tag or commit (default: main)")
    pull.set_defaults(func=run_pull)


def run_search(args, out=None) -> int:
    from ..errors import InvalidArgumentError
    from ..hub.client import Hub

    out = out or sys.stdout
    if args.limit < 1:
        raise InvalidArgumentError(f"--limit must be at least 1, got {args.limit}")
    hits = Hub().search(args.text, limit=args.limit)
    if not hits:
        out.write(f"no repository matching {args.text!r} has GGUF or safetensors weights Stowage runs\n")
        return 0
    rows = [("REPO", "FORMAT", "ARCH", "DOWNLOADS", "LIKES")]
    rows += [(h.repo + (" (gated)" if h.gated else ""), ",".join(h.formats), h.architecture or "-",
              f"{h.downloads:,}", f"{h.likes:,}") for h in hits]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")
    return 0


def run_pull(args, out=None) -> int:
    from ..hub.client import Hub
    from ..hub.download import pull

    out = out or sys.stdout
    hub = Hub()
    repo, file = _split(args.repo)
    files = hub.files(repo, revision=args.revision)
    model = files.find(file=args.file or file, quant=args.quant)
    sys.stderr.write(f"{repo} {model.name} ({model.quant or model.format}, {format_bytes(model.size_bytes)}): "
                     f"{_fit(hub, model)}\nDownloading\n")
    bar = ProgressBar(sys.stderr)
    try:
        path = pull(hub, model, ref=args.revision or "main", progress=bar, cancel=threading.Event())
    except KeyboardInterrupt:
        bar.end()
        sys.stderr.write("stowage: download interrupted; run the same pull again to resume it\n")
        return 130
    bar.end()
    out.write(f"{path}\n")
    sys.stderr.write(f"Ready: stowage chat {path}\n")
    return 0


def _fit(hub, model) -> str:
    """The verdict on this machine at the default context (or the model's maximum where smaller), from the header."""
    from ..defaults import DEFAULT_CONTEXT
    from ..errors import HubAccessError, StowageError
    from ..hub.header import HeaderReader, header_cache_dir
    from ..hub.verdict import verdict
    from ..planning.budgets import detect_budgets
    from ..planning.plan import PlanRequest

    reader = HeaderReader(hub, header_cache_dir())
    try:
        context_tokens = min(DEFAULT_CONTEXT, reader.model_info(model).max_position_embeddings)
        return "on this machine, " + verdict(reader, model, PlanRequest(context_tokens), detect_budgets()).text
    except HubAccessError:
        raise
    except StowageError as e:
        return f"cannot plan it ({e})"


def _split(argument: str) -> tuple[str, str | None]:
    from ..errors import InvalidArgumentError

    match = REPO_ARGUMENT.match(argument)
    if match is None:
        raise InvalidArgumentError(f"{argument!r} is not a repository (owner/name, or owner/name:FILE)")
    return match["repo"], match["file"]


class ProgressBar:
    """One line on a terminal, rewritten: file, bytes done of total, rate, time left."""

    def __init__(self, stream):
        self.stream, self.width = stream, 0

    def __call__(self, p) -> None:
        done = p.done_bytes / p.total_bytes if p.total_bytes else 1.0
        filled = int(done * BAR_WIDTH)
        left = f", {format_duration(p.seconds_left)} left" if p.seconds_left is not None and done < 1 else ""
        line = (f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done:4.0%} {format_bytes(p.done_bytes)} of "
                f"{format_bytes(p.total_bytes)}, {format_bytes(int(p.rate_bytes_per_s))}/s{left}  {p.file}")
        self.stream.write("\r" + line.ljust(self.width))
        self.stream.flush()
        self.width = len(line)

    def end(self) -> None:
        if self.width:
            self.stream.write("\n")
            self.stream.flush()
            self.width = 0

