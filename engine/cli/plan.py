"""`stowage plan MODEL --context N ...`: print the memory plan (or why it does not fit) before loading anything; MODEL
is a folder or a .gguf file, or a repository of the Hugging Face Hub (owner/name[:FILE]), planned from its headers."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from typing import TYPE_CHECKING

from ..defaults import BLOCK_SIZE, PREFILL_CHUNK
from ..dtypes import COMPUTE_NAMES, KV_ALIASES, KV_NAMES, kv_name
from ..errors import HubError, InvalidArgumentError, StowageError
from ..units import format_bytes, parse_size
from .hub import is_remote

if TYPE_CHECKING:  # planning imports torch: only a plan that runs needs it, never the parser (`stowage --help`)
    from ..planning.budgets import Budgets
    from ..planning.plan import PlanRequest

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_BAD_MODEL = 0, 1, 2


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _kv_dtype(text: str) -> str | None:
    """A --kv-dtype: one cache type, or K's and V's as K/V (q8_0/q4_0); "auto" (None): the compute dtype."""
    if text == "auto":
        return None
    try:
        return kv_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


KV_DTYPE_HELP = (f"KV cache dtype: {', '.join(KV_NAMES)}, or K's and V's apart as K/V (q8_0/q4_0); default auto: the "
                 "compute dtype. fp8 and q8_0 take about 1 byte per value, q4_0 0.56 (docs/kernels.md)")


def _gpu_layers(text: str) -> int | None:
    if text == "auto":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of layers (0 = CPU only) or 'auto'")
    return int(text)


def _cpu_expert_layers(text: str) -> int | None:
    if text == "auto":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of layers whose experts stay on the CPU, or 'auto'")
    return int(text)


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `plan` subcommand; its `func` returns the exit status (0 fits, 1 does not, 2 bad model)."""
    p = subparsers.add_parser(
        "plan", help="show what a context size costs on each device, before loading",
        description="Plan the memory of MODEL for a context of N tokens: KV cache first, then layers onto the "
                    "GPUs while they fit, the rest on the CPU. MODEL may also be a repository of the Hugging Face "
                    "Hub, owner/name[:FILE], planned from the files' headers before anything is downloaded (a "
                    "repository of several models: one verdict each). Exit status 0 when it fits, 1 when it does "
                    "not, 2 for a model or an argument that is wrong.")
    p.add_argument("model_dir", metavar="MODEL", type=Path,
                   help="a model folder (config.json, *.safetensors) or a .gguf file; or owner/name[:FILE] on the Hub")
    p.add_argument("--context", dest="context_tokens", metavar="N", type=int,
                   help="context tokens (default: the largest that fits, up to the model's maximum)")
    p.add_argument("--kv-dtype", default="auto", type=_kv_dtype, metavar="TYPE", help=KV_DTYPE_HELP)
    p.add_argument("--dtype", choices=sorted(COMPUTE_NAMES), help="convert the weights to this dtype (a counted copy)")
    p.add_argument("--gpu-budget", metavar="SIZE", type=_size, action="append",
                   help="plan as if a GPU had SIZE free (e.g. 24GiB); repeat for more GPUs; the safety buffer "
                        "max(512MiB, 2%%) still comes off it. Default: every NVIDIA GPU's free memory")
    p.add_argument("--ram-budget", metavar="SIZE", type=_size,
                   help="plan as if SIZE of RAM were available; the RAM reserve max(1GiB, 5%%) still comes off it. "
                        "Default: available RAM now (never swap)")
    p.add_argument("--ram-limit", metavar="SIZE", type=_size, help="never plan more than SIZE into RAM")
    p.add_argument("--gpu-safety", metavar="SIZE", type=_size, help="GPU safety buffer (default max(512MiB, 2%%))")
    p.add_argument("--gpu-layers", metavar="N", type=_gpu_layers, default=None,
                   help="layers on the GPUs: a number (0 = CPU only) or auto (default)")
    p.add_argument("--cpu-expert-layers", metavar="N", type=_cpu_expert_layers, default=None,
                   help="a model of experts: keep the last N layers' experts on the CPU, the others beside their "
                        "layer; auto (default): as many layers' experts on the GPU as fit (docs/moe.md)")
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE, help=f"tokens per KV block (default {BLOCK_SIZE})")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                   help=f"prompt tokens per forward pass (default {PREFILL_CHUNK})")
    p.add_argument("--parallel", metavar="N", type=int, default=1,
                   help="sequences whose KV cache is held at once, each of the whole context (stowage serve "
                        "--parallel; default 1)")
    p.add_argument("--kv-disk-budget", metavar="SIZE", type=_size, default=None,
                   help="disk space for evicted conversations' KV cache, read back when they resume (stowage "
                        "serve --kv-disk-budget; default min(4GiB, 10%% of the free disk); 0: none)")
    p.add_argument("--json", action="store_true", help="print one JSON object, whether or not it fits")
    p.set_defaults(func=run_plan)
    return p


def budgets_from_args(args: argparse.Namespace) -> Budgets:
    """Given budgets where the arguments state them, detected ones elsewhere."""
    from ..planning.budgets import Budgets, detect_disk, detect_gpus, detect_ram, gpu_budget, ram_budget

    if args.gpu_budget:
        gpus = tuple(gpu_budget(i, free, safety_bytes=args.gpu_safety) for i, free in enumerate(args.gpu_budget))
        gpu_note = f"given: {len(gpus)} GPU budget(s)"
    else:
        gpus, gpu_note = detect_gpus(args.gpu_safety)
    if args.ram_budget is not None:
        ram, ram_note = ram_budget(args.ram_budget, limit_bytes=args.ram_limit), "given RAM budget"
    else:
        ram, ram_note = detect_ram(limit_bytes=args.ram_limit), "available RAM"
    return Budgets(gpus, ram, f"{gpu_note}; {ram_note}", detect_disk())


def run_plan(args: argparse.Namespace, out=None) -> int:
    """Print the plan (a table, or JSON with --json); return the exit status."""
    out = out or sys.stdout
    try:
        _check_counts(args)
        if is_remote(str(args.model_dir)):
            return _run_remote_plan(args, out)
        from ..planning.inspect import inspect

        info = inspect(args.model_dir)
        request = _request(args)
    except (StowageError, ValueError) as e:
        if args.json:
            print(json.dumps({"fits": False, "error": str(e)}), file=out)
        else:
            print(f"stowage plan: {e}", file=sys.stderr)
        return EXIT_BAD_MODEL
    return _print_plan(args, out, info, request)


def _request(args: argparse.Namespace) -> PlanRequest:
    from ..planning.plan import PlanRequest

    return PlanRequest(args.context_tokens or 1, kv_dtype=KV_ALIASES.get(args.kv_dtype, args.kv_dtype),
                       dtype=args.dtype, gpu_layers=args.gpu_layers, cpu_expert_layers=args.cpu_expert_layers,
                       block_size=args.block_size,
                       prefill_chunk=args.prefill_chunk, num_seqs=args.parallel, kv_disk_budget=args.kv_disk_budget)


def _print_plan(args: argparse.Namespace, out, info, request: PlanRequest) -> int:
    from stowage.kernels import cpu_decode

    from ..planning.plan import max_context, plan
    from ..planning.report import format_table, to_dict

    budgets = budgets_from_args(args)
    if args.context_tokens is None:
        request = request.with_context(max_context(info, request, budgets) or request.block_size)
    result = plan(info, request, budgets)
    if args.json:
        print(json.dumps({**to_dict(result), "cpu_decode": cpu_decode.active()}, indent=2), file=out)
    else:
        print(format_table(result), file=out)
        print(f"CPU decode step: {cpu_decode.active()}", file=out)
    return EXIT_FITS if result.fits else EXIT_DOES_NOT_FIT


# Each count's option, for messages (PlanRequest names its fields, which the user never typed).
_COUNTS = {"context_tokens": "--context", "block_size": "--block-size", "prefill_chunk": "--prefill-chunk",
           "parallel": "--parallel"}


def _check_counts(args: argparse.Namespace) -> None:
    """--context 0 is refused as chat and serve refuse it (exit 2), not planned as one token."""
    for name, option in _COUNTS.items():
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InvalidArgumentError(f"{option} must be at least 1, got {value}")


def _run_remote_plan(args: argparse.Namespace, out) -> int:
    """A Hub model planned from its headers: one file's plan as for a local one; a repository's, a verdict each."""
    from ..hub.client import Hub
    from ..hub.header import HeaderReader, header_cache_dir
    from ..hub.verdict import verdict
    from .hub import _split

    hub = Hub()
    repo, file = _split(str(args.model_dir))
    try:
        files = hub.files(repo)
    except HubError as e:  # perhaps a local path mistyped: say both
        raise HubError(f"{args.model_dir} is no file or folder here; as a Hugging Face repository: {e}") from e
    if files.gated_note:
        print(f"note: {files.gated_note}", file=sys.stderr)
    reader, request = HeaderReader(hub, header_cache_dir()), _request(args)
    if not files.models:
        raise HubError(f"{repo} holds no model Stowage can run (GGUF files, or safetensors with a config.json)")
    if file is not None or len(files.models) == 1:
        return _print_plan(args, out, reader.model_info(files.find(file=file)), request)
    if args.context_tokens is None:
        raise InvalidArgumentError(f"{repo} holds {len(files.models)} models: give --context N to see which fit, "
                                   f"or plan one as {repo}:FILE")
    budgets = budgets_from_args(args)
    verdicts = [verdict(reader, m, request, budgets) for m in files.models]
    if args.json:
        print(json.dumps({"repo": repo, "revision": files.revision, "models": [
            {"file": v.model.name, "quant": v.model.quant, "size_bytes": v.model.size_bytes, "fits": v.fits,
             "verdict": v.text, "plan": to_dict(v.plan) if v.plan else None} for v in verdicts]}, indent=2), file=out)
    else:
        width = max(len(v.model.name) for v in verdicts)
        for v in verdicts:
            print(f"{v.model.name.ljust(width)}  {format_bytes(v.model.size_bytes):>10}  {v.text}", file=out)
    return EXIT_FITS if any(v.fits for v in verdicts) else EXIT_DOES_NOT_FIT
