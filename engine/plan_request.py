"""What the user asks of the planner (engine/planning/plan.py): a context size, dtypes, GPU layers, sequences; and
how the request crosses to an engine child (`serve --plan-request`). Apart from the planner so that a process
that only starts an engine (`stowage generate`, the app) never imports torch for it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace

from .defaults import BLOCK_SIZE, PREFILL_CHUNK
from .dtypes import check_compute, check_kv
from .errors import InvalidArgumentError


@dataclass(frozen=True)
class PlanRequest:
    """What the user asks for; None fields mean "decide for me"."""

    context_tokens: int
    kv_dtype: str | None = None  # None: the compute dtype
    dtype: str | None = None  # convert floating weights to this dtype (a copy, counted); None keeps them as stored
    gpu_layers: int | None = None  # None: as many as fit; 0: CPU only; more than the model has: all of them
    cpu_expert_layers: int | None = None  # None: as many layers' experts on the GPU as fit; N: the last N on the CPU
    block_size: int = BLOCK_SIZE
    prefill_chunk: int = PREFILL_CHUNK
    num_seqs: int = 1  # sequences whose KV cache is held at once (each of context_tokens)
    kv_disk_budget: int | None = None  # bytes of evicted conversations' K/V on disk; None: the default; 0: none

    def __post_init__(self):
        for name in ("context_tokens", "block_size", "prefill_chunk", "num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"PlanRequest.{name} must be at least 1, got {getattr(self, name)}")
        if self.kv_disk_budget is not None and self.kv_disk_budget < 0:
            raise ValueError(f"PlanRequest.kv_disk_budget must be None (default) or at least 0, "
                             f"got {self.kv_disk_budget}")
        for name in ("gpu_layers", "cpu_expert_layers"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"PlanRequest.{name} must be None (auto) or at least 0, got {getattr(self, name)}")
        if self.kv_dtype is not None:
            check_kv(self.kv_dtype)  # raises ValueError naming the choices
        if self.dtype is not None:
            check_compute(self.dtype)

    def with_context(self, context_tokens: int) -> "PlanRequest":
        return replace(self, context_tokens=context_tokens)

    def to_json(self) -> str:
        """The request as one JSON object: how it crosses to the engine child (`serve --plan-request`)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "PlanRequest":
        """The request to_json wrote; InvalidArgumentError naming what is wrong with anything else."""
        try:
            values = json.loads(text)
        except ValueError as e:
            raise InvalidArgumentError(f"--plan-request is not JSON: {e}") from None
        known = {f.name for f in fields(cls)}
        if not isinstance(values, dict) or not values.keys() <= known or "context_tokens" not in values:
            raise InvalidArgumentError(f"--plan-request must be an object with context_tokens and any of "
                                       f"{', '.join(sorted(known - {'context_tokens'}))}; got {text!r:.120}")
        if not all(isinstance(v, (int, str, type(None))) and not isinstance(v, bool) for v in values.values()):
            raise InvalidArgumentError(f"--plan-request values are integers, names or null; got {text!r:.120}")
        try:
            return cls(**values)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"--plan-request: {e}") from None
