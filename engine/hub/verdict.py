"""Whether a model of the Hub fits, before a byte of its weights is downloaded: the planner's own plan of the
ModelInfo its headers give (header.py), for the user's context, KV dtype and budgets, in one line."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import HubError, StowageError
from ..planning.budgets import Budgets
from ..planning.plan import Plan, PlanRequest, plan
from ..units import format_bytes
from .files import RemoteModel
from .header import HeaderReader


@dataclass(frozen=True)
class Verdict:
    """A model's fit: its plan, or why there is none (a header Stowage cannot read, an architecture it does not run)."""

    model: RemoteModel
    plan: Plan | None
    error: str | None = None

    @property
    def fits(self) -> bool:
        return self.plan is not None and self.plan.fits

    @property
    def gpu_layers(self) -> int:
        """Layers the plan puts on a GPU."""
        return sum(len(d.layers) for d in self.plan.devices if d.device != "cpu") if self.plan else 0

    @property
    def text(self) -> str:
        """ "fits on the GPU at 32,768 tokens", "24 of 36 layers on the GPU ...", "does not fit: ..."."""
        p = self.plan
        if p is None:
            return f"cannot plan: {self.error}"
        if not p.fits:
            return f"does not fit: {p.error}"
        largest = f"; largest context {p.max_context_tokens:,} tokens"
        has_gpu = any(d.device != "cpu" for d in p.devices)
        if not has_gpu:
            where = "fits in RAM (no GPU)"
        elif self.gpu_layers == 0:
            where = "fits in RAM (no layer fits on the GPU)"
        elif self.gpu_layers == p.num_layers:
            where = "fits on the GPU"
        else:
            where = f"fits: {self.gpu_layers} of {p.num_layers} layers on the GPU"
        used = sum(d.total_bytes for d in p.devices)
        return f"{where} at {p.context_tokens:,} tokens ({format_bytes(used)}){largest}"


def verdict(reader: HeaderReader, model: RemoteModel, request: PlanRequest, budgets: Budgets) -> Verdict:
    """The model's plan for `request` from its headers alone; a header that cannot be planned is a Verdict with
    the reason, never an exception (the Hub's own errors, HubError, still raise: nothing can be listed then)."""
    try:
        return Verdict(model, plan(reader.model_info(model), request, budgets))
    except HubError:
        raise
    except StowageError as e:  # a header Stowage cannot read, or a request this model cannot take (q4_0 KV, ...)
        return Verdict(model, None, str(e))
