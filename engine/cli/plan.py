"""`stowage plan MODEL_DIR --context N ...`: print the memory plan (or why it does not fit) before loading anything."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stowage.kernels import cpu_decode

from ..defaults import BLOCK_SIZE, PREFILL_CHUNK
from ..dtypes import COMPUTE, KV, KV_ALIASES
from ..errors import StowageError
from ..units import parse_size
from ..planning.budgets import Budgets, detect_disk, detect_gpus, detect_ram, gpu_budget, ram_budget
from ..planning.inspect import inspect
from ..planning.plan import PlanRequest, max_context, plan
from ..planning.report import format_table, to_dict

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_BAD_MODEL = 0, 1, 2


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _gpu_layers(text: str) -> int | None:
    if text == "auto":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of layers (0 = CPU only) or 'auto'")
    return int(text)


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `plan` subcommand; its `func` returns the exit status (0 fits, 1 does not, 2 bad model)."""
    p = subparsers.add_parser(
        "plan", help="show what a context size costs on each device, before loading",
        description="Plan the memory of MODEL_DIR for a context of N tokens: KV cache first, then layers onto the "
                    "GPUs while they fit, the rest on the CPU. Exit status 0 when it fits, 1 when it does not.")
    p.add_argument("model_dir", metavar="MODEL_DIR", type=Path, help="folder with config.json and *.safetensors")
    p.add_argument("--context", dest="context_tokens", metavar="N", type=int,
                   help="context tokens (default: the largest that fits, up to the model's maximum)")
    p.add_argument("--kv-dtype", default="auto", choices=sorted(KV) + sorted(KV_ALIASES),
                   help="KV cache dtype (default auto: the compute dtype)")
    p.add_argument("--dtype", choices=sorted(COMPUTE), help="convert the weights to this dtype (a counted copy)")
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
        info = inspect(args.model_dir)
        request = PlanRequest(args.context_tokens or 1, kv_dtype=KV_ALIASES.get(args.kv_dtype, args.kv_dtype),
                              dtype=args.dtype, gpu_layers=args.gpu_layers, block_size=args.block_size,
                              prefill_chunk=args.prefill_chunk, num_seqs=args.parallel,
                              kv_disk_budget=args.kv_disk_budget)
    except (StowageError, ValueError) as e:
        if args.json:
            print(json.dumps({"fits": False, "error": str(e)}), file=out)
        else:
            print(f"stowage plan: {e}", file=sys.stderr)
        return EXIT_BAD_MODEL
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
