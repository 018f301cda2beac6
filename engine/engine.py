"""Load a model folder and chat with it: the one object the CLI and the GUI hold."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint import Checkpoint
from .config import ModelConfig
from .errors import InsufficientMemoryError
from .generation import Generation
from .kv_cache import KV_DTYPES, CacheSpec, KVCache, Sequence
from .model import Transformer
from .sampler import SamplingParams
from .tokenizer import Tokenizer
from .weights import head_tensor_names, layer_tensor_names, load_layers, place

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
STORED_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}

Progress = Callable[[float, str], None]


@dataclass(frozen=True)
class LoadOptions:
    context_tokens: int = 4096
    dtype: str | None = None  # weights/compute dtype; None keeps the stored dtype (no copy on the CPU)
    kv_dtype: str | None = None  # None: the compute dtype
    block_size: int = 16
    prefill_chunk: int = 512
    num_seqs: int = 1
    layer_devices: tuple[str, ...] | None = None  # one per layer; None: all on the CPU
    embed_device: str = "cpu"
    head_device: str | None = None  # final norm + lm_head; None: the last layer's device

    def __post_init__(self):
        if self.context_tokens < 1 or self.block_size < 1 or self.prefill_chunk < 1:
            raise ValueError("context_tokens, block_size and prefill_chunk must be positive")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")


@dataclass
class EngineStats:
    prefilled_tokens: int = 0  # tokens run through prefill over the engine's life
    reused_tokens: int = 0  # prompt tokens whose K/V were already cached
    generated_tokens: int = 0


@dataclass
class Conversation:
    """A chat whose K/V stay cached between turns."""

    seq: Sequence = field(default_factory=Sequence)
    last_used: float = 0.0

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens


class Engine:
    def __init__(self, model_dir: Path, config: ModelConfig, tokenizer: Tokenizer, model: Transformer,
                 cache: KVCache, options: LoadOptions, checkpoint: Checkpoint):
        self.model_dir = model_dir
        self.name = model_dir.name
        self.config = config
        self.tokenizer = tokenizer
        self.model = model
        self.cache = cache
        self.options = options
        self.stats = EngineStats()
        self._checkpoint = checkpoint
        self._conversations: list[Conversation] = []
        self.eos_ids = set(config.eos_token_ids) | ({tokenizer.token_id(tokenizer.eos_token)} - {None})

    @classmethod
    def load(cls, model_dir: str | Path, options: LoadOptions = LoadOptions(),
             progress: Progress | None = None, cancel: threading.Event | None = None) -> "Engine":
        model_dir = Path(model_dir)
        report = progress or (lambda fraction, message: None)
        is_cancelled = cancel.is_set if cancel is not None else (lambda: False)
        report(0.0, "reading config and headers")
        config = ModelConfig.from_dir(model_dir)
        checkpoint = Checkpoint(model_dir)
        tokenizer = Tokenizer(model_dir)
        head_names = head_tensor_names(config, checkpoint.specs)
        checkpoint.require(list(head_names.values()) + [
            n for i in range(config.num_layers) for n in layer_tensor_names(config, i).values()])
        dtype = DTYPES[options.dtype] if options.dtype else None
        compute_dtype = dtype or DTYPES.get(STORED_DTYPES.get(checkpoint.specs[head_names["embed"]].dtype), torch.float32)
        layer_devices = [torch.device(d) for d in (options.layer_devices or ["cpu"] * config.num_layers)]
        if len(layer_devices) != config.num_layers:
            raise ValueError(f"layer_devices names {len(layer_devices)} devices for {config.num_layers} layers")
        head_device = torch.device(options.head_device) if options.head_device else layer_devices[-1]
        spec = CacheSpec(config.num_kv_heads, config.head_dim,
                         KV_DTYPES[options.kv_dtype] if options.kv_dtype else compute_dtype, options.block_size)
        # The KV cache first: it is what the user asked for, and a shortage should show before weights move.
        report(0.0, f"allocating KV cache for {options.context_tokens:,} tokens")
        try:
            cache = KVCache(spec, layer_devices, options.context_tokens, options.num_seqs)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise InsufficientMemoryError(f"cannot allocate the KV cache for {options.context_tokens:,} tokens: {e}") from e
        embed_device = torch.device(options.embed_device)
        head = place(checkpoint, {"embed": head_names["embed"]}, embed_device, dtype)
        tail = place(checkpoint, {k: v for k, v in head_names.items() if k != "embed"}, head_device, dtype)
        if tail.device == head.device and head_names["lm_head"] == head_names["embed"]:
            tail.tensors["lm_head"] = head["embed"]  # tied: share the one tensor
        head.tensors |= tail.tensors
        head.copied_bytes += tail.copied_bytes
        layers = load_layers(checkpoint, config, layer_devices, dtype, report, is_cancelled)
        model = Transformer(config, head, layers, head_device, cache.max_tokens)
        report(1.0, "loaded")
        return cls(model_dir, config, tokenizer, model, cache, options, checkpoint)

    # -- conversations -------------------------------------------------------------------------
    def new_conversation(self) -> Conversation:
        conv = Conversation()
        self._conversations.append(conv)
        return conv

    def release(self, conv: Conversation) -> None:
        self.cache.release(conv.seq)
        if conv in self._conversations:
            self._conversations.remove(conv)

    def make_room(self, conv: Conversation, num_tokens: int) -> None:
        """Free other conversations' blocks (least recently used first) until conv can hold num_tokens."""
        if num_tokens > self.cache.max_tokens:
            raise InsufficientMemoryError(
                f"the conversation needs {num_tokens:,} tokens but the KV cache holds {self.cache.max_tokens:,}; "
                "load with a larger context or start a new conversation"
            )
        needed = self.cache.spec.num_blocks(num_tokens) - len(conv.seq.block_table)
        if needed <= self.cache.allocator.num_free:  # the per-token fast path
            return
        for other in sorted(self._conversations, key=lambda c: c.last_used):
            if other is not conv:
                self.cache.release(other.seq)
            if self.cache.allocator.num_free >= needed:
                break

    # -- generation ----------------------------------------------------------------------------
    def generate(self, conv: Conversation, prompt_ids: list[int], sampling: SamplingParams,
                 *, cancel: threading.Event | None = None) -> Generation:
        """A lazy generation: iterate it for TokenEvents; `.result` once finished."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        return Generation(self, conv, list(prompt_ids), sampling, cancel)

    def chat(self, conv: Conversation, messages: list[dict], sampling: SamplingParams,
             *, cancel: threading.Event | None = None) -> Generation:
        return self.generate(conv, self.tokenizer.apply_chat_template(messages), sampling, cancel=cancel)

    def memory_report(self) -> dict[str, dict[str, int]]:
        """Bytes the engine holds per device: weights copied onto it, weights mapped in place, KV cache."""
        report: dict[str, dict[str, int]] = {}
        def add(device, key, n):
            d = report.setdefault(str(device), {"weights_copied": 0, "weights_mapped": 0, "kv_cache": 0})
            d[key] += n
        for ts in [self.model.head, *self.model.layers]:
            add(ts.device, "weights_copied", ts.copied_bytes)
            add(ts.device, "weights_mapped", ts.num_bytes - ts.copied_bytes)
        for t in self.cache.k_cache + self.cache.v_cache:
            add(t.device, "kv_cache", t.numel() * t.element_size())
        return report

    def close(self) -> None:
        self.model = None
        self.cache = None
        self._checkpoint.close()
        self._conversations.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
