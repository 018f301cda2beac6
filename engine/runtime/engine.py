"""Load a model (a Hugging Face folder or a GGUF file) and chat with it: the one object the CLI and the GUI hold."""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from stowage.kernels import attention_ops

from ..formats.checkpoint import Checkpoint
from ..dtypes import COMPUTE, kv_dtypes
from ..errors import InsufficientMemoryError, InvalidArgumentError, ModelFormatError
from ..formats.source import open_source
from .generation import Generation, PrefillProgress
from .kv_cache import CacheSpec, KVCache
from ..formats.layout import ModelLayout
from .model import Transformer
from ..planning.inspect import compute_dtype_of, converted_names
from ..planning.plan import Plan
from .sampler import SamplingParams
from ..serving.prefix_pool import PrefixPool
from ..serving.scheduler import Scheduler
from ..text.tokenizer import Tokenizer
from .weights import load_experts, load_layers, place

Progress = Callable[[float, str], None]


@dataclass
class EngineStats:
    prefilled_tokens: int = 0  # tokens run through prefill over the engine's life
    reused_tokens: int = 0  # prompt tokens whose K/V were already cached
    generated_tokens: int = 0


class Engine:
    def __init__(self, model_dir: Path, layout: ModelLayout, tokenizer: Tokenizer, model: Transformer,
                 cache: KVCache, plan: Plan, checkpoint: Checkpoint, devices: dict[str, torch.device]):
        self.model_dir = model_dir
        self.name = model_dir.name
        self.layout = layout
        self.config = layout.config
        self.tokenizer = tokenizer
        self.model = model
        self.cache = cache
        self.plan = plan
        self.prefill_chunk = plan.prefill_chunk
        self.stats = EngineStats()
        self._checkpoint = checkpoint
        self._devices = devices  # the plan's device names -> where their tensors live
        self.eos_ids = set(self.config.eos_token_ids) | ({tokenizer.token_id(tokenizer.eos_token)} - {None})
        builtin = tokenizer.use_builtin_template(self.config.model_type)  # GGUF files often carry no template
        if builtin is not None:
            self.eos_ids |= {tokenizer.token_id(t) for t in builtin.stop_tokens} - {None}
        # The cached conversations and their eviction, for this engine's replies in process and served alike
        self.pool = PrefixPool(self)
        # In-process replies run one at a time, stepped by the thread that iterates each, in the order their
        # iterations start; a server runs its own scheduler of the plan's sequences on its thread (server/serving.py).
        self.scheduler = Scheduler(self, max_running=1, max_waiting=sys.maxsize)

    @classmethod
    def load(cls, model_dir: str | Path, plan: Plan, progress: Progress | None = None,
             cancel: threading.Event | None = None, *, simulate: dict[str, str] | None = None) -> "Engine":
        """Load exactly what `plan` says: the KV cache first, then the embeddings, head and layers on their devices.

        `simulate` maps plan devices to real ones (e.g. {"cuda:0": "cpu"}) for checks of the per-device accounting
        on a machine without them; memory is still reported under the plan's names."""
        model_dir = Path(model_dir)
        plan.require_fit()
        report = progress or (lambda fraction, message: None)
        is_cancelled = cancel.is_set if cancel is not None else (lambda: False)
        report(0.0, "reading config and headers")
        source = open_source(model_dir)
        config, specs = source.config, source.specs
        # mapped in place; matrices in ggml blocks compute in the plan's dtype, tile by tile
        checkpoint = source.weights(COMPUTE[plan.dtype], converts=plan.forced_dtype is not None)
        tokenizer = source.tokenizer
        layout = source.layout()
        if plan.num_layers != layout.num_layers or compute_dtype_of(layout, specs, plan.forced_dtype) != plan.dtype:
            raise ModelFormatError(f"{model_dir.name}: the plan was made for another model ({plan.num_layers} layers, "
                                   f"{plan.dtype}); plan again for this model")
        layout.check_token_ids(tokenizer.num_token_ids, model_dir.name)
        expert_devices = plan.expert_devices or plan.layer_devices  # a layer's experts may sit apart (docs/moe.md)
        names = set(plan.layer_devices) | set(expert_devices) | {plan.embed_device, plan.head_device}
        devices = {name: torch.device((simulate or {}).get(name, name)) for name in names}
        layer_devices = [devices[d] for d in plan.layer_devices]
        for name in set(plan.layer_devices):
            cls._check_kernel(plan, name, devices[name], simulated=name in (simulate or {}))
        dtype = COMPUTE[plan.dtype]
        converted = converted_names(layout, specs, plan.dtype, forced=plan.forced_dtype is not None)
        k_dtype, v_dtype = kv_dtypes(plan.kv_dtype)
        spec = CacheSpec(config.num_kv_heads, config.head_dim, k_dtype, plan.block_size, v_dtype)
        # The KV cache first: it is what the user asked for, and a shortage should show before weights move.
        report(0.0, f"allocating KV cache for {plan.context_tokens:,} tokens")
        try:
            cache = KVCache(spec, layer_devices, plan.context_tokens, plan.num_seqs,
                            layer_windows=layout.config.layer_windows, prefill_chunk=plan.prefill_chunk)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise InsufficientMemoryError(f"cannot allocate the KV cache for {plan.context_tokens:,} tokens: {e}") from e
        embed = place(checkpoint, {"embed": layout.embed}, devices[plan.embed_device], dtype, plan.embed_device,
                      converted=converted)
        shared = embed if layout.tied and plan.head_device == plan.embed_device else None
        head = place(checkpoint, layout.head_names(), devices[plan.head_device], dtype, plan.head_device, shared,
                     converted=converted)
        # progress by bytes: a model of experts is mostly its experts, placed after the layers
        share = 1 - sum(d.expert_bytes for d in plan.devices) / max(1, sum(d.weights_bytes for d in plan.devices))
        layers = load_layers(checkpoint, layout.layers, layer_devices, plan.layer_devices, dtype,
                             lambda f, message: report(f * share, message), is_cancelled, converted)
        experts = load_experts(checkpoint, layout, [devices[d] for d in expert_devices], expert_devices, dtype,
                               lambda f, message: report(share + f * (1 - share), message), is_cancelled, converted)
        model = Transformer(config, embed, head, layers, cache.context_tokens, qk_order=source.qk_order,
                            experts=experts)
        # The objects a load leaves (tokenizer tables, tensor records) live as long as the model: out of the
        # collector's way, so the few objects each decode step makes do not have them scanned again and again.
        # The young generations only: a full collection walks every object torch left, a large part of a small
        # load, and found no garbage there (docs/benchmarks.md, "Figures behind code comments").
        gc.collect(1)
        gc.freeze()
        report(1.0, "loaded")
        return cls(model_dir, layout, tokenizer, model, cache, plan, checkpoint, devices)

    @staticmethod
    def _check_kernel(plan: Plan, name: str, device: torch.device, simulated: bool) -> None:
        # The planner charged the workspace of the kernel it expected on this device; the same must run.
        planned, running = plan.device(name).attention, attention_ops(device).NAME
        if planned != running and not simulated:
            raise InsufficientMemoryError(
                f"the plan charged {name} for the {planned!r} attention kernel, but {running!r} would run there "
                "(a plan made on another machine, or STOWAGE_FORCE_REFERENCE changed since); plan again")

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, cancel: threading.Event | None = None,
                 progress: PrefillProgress | None = None) -> Generation:
        """A lazy generation: iterate it for TokenEvents; `.result` once finished. `progress(done, total)` is called
        after each prefill chunk (the tokens computed so far, of those the cache did not hold).

        The longest prefix of the prompt the engine holds cached (a chat's history, from its last turn) is reused;
        cached conversations are evicted least recently used first when a reply needs their room."""
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise InvalidArgumentError("the prompt is empty: give at least one token (a chat message, or text)")
        rows = self.layout.num_embeddings
        bad = next((i for i in prompt_ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < rows), None)
        if bad is not None:
            raise InvalidArgumentError(f"the prompt holds token id {bad!r:.40}, but {self.name}'s token ids are "
                                       f"integers from 0 to {rows - 1:,}; tokenize with the model's own tokenizer")
        context_tokens = self.cache.context_tokens
        if len(prompt_ids) >= context_tokens:
            raise InsufficientMemoryError(f"the prompt takes {len(prompt_ids):,} tokens, but the context holds "
                                          f"{context_tokens:,} with at least one left for the reply; shorten it, "
                                          "or load with a larger context")
        return Generation(self.scheduler, prompt_ids, sampling, cancel, progress=progress)

    def chat(self, messages: list[dict], sampling: SamplingParams, *, cancel: threading.Event | None = None,
             progress: PrefillProgress | None = None) -> Generation:
        """generate() on the chat template's tokens for `messages` ([{"role", "content"}], at least one)."""
        if not messages:
            raise InvalidArgumentError("no messages to reply to: give at least one {\"role\", \"content\"} message")
        return self.generate(self.tokenizer.apply_chat_template(messages), sampling, cancel=cancel,
                             progress=progress)

    def check_weights(self) -> None:
        """Raise ModelFormatError if a weight file changed on disk since it was mapped: called before each step,
        since reading a page of a truncated mapping would kill the process with SIGBUS (docs/robustness.md)."""
        check = getattr(self._checkpoint, "check_unchanged", None)
        if check is not None:
            check()

    def memory_report(self) -> dict[str, dict[str, int]]:
        """Bytes the engine holds per plan device: weights copied onto it, weights mapped in place, KV cache."""
        report: dict[str, dict[str, int]] = {}

        def add(device: str, key: str, n: int) -> None:
            d = report.setdefault(device, {"weights_copied": 0, "weights_mapped": 0, "kv_cache": 0})
            d[key] += n

        # a tied head on the embeddings' device shares their storage: count it once there (on another
        # device it is a copy of its own, even where a simulated device maps the same file pages)
        seen: dict[str, set[int]] = {}
        for ts in [self.model.embed, self.model.head, *self.model.layers, *filter(None, self.model.experts)]:
            mapped = ts.bytes_excluding(seen.setdefault(ts.label, set())) - ts.copied_bytes
            add(ts.label, "weights_copied", ts.copied_bytes)
            add(ts.label, "weights_mapped", mapped)
        for name, k, v in zip(self.plan.layer_devices, self.cache.k_cache, self.cache.v_cache):
            add(name, "kv_cache", k.numel() * k.element_size() + v.numel() * v.element_size())
        return report

    def close(self) -> None:
        self.model = None
        self.cache = None
        self.pool = self.scheduler = None  # they hold the cache too (the pool's disk store)
        self._checkpoint.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
