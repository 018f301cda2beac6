"""Planning, in the order it flows: inspect (headers) -> budgets (devices) -> workspace (kernels' scratch)
-> plan (placement) -> report (words). Nothing here allocates; `plan_for` is the usual way in."""

from __future__ import annotations

from pathlib import Path

from ..defaults import DEFAULT_CONTEXT
from .budgets import Budgets, detect_budgets
from .inspect import ModelInfo, inspect
from .plan import Plan, PlanRequest, check, max_context, plan


def plan_for(model_dir: str | Path, context_tokens: int, budgets: Budgets | None = None, **request) -> Plan:
    """A plan that fits for `context_tokens` (budgets None: this machine's now); raises InsufficientMemoryError."""
    return check(inspect(model_dir), PlanRequest(context_tokens, **request), budgets or detect_budgets())


def default_context_tokens(model_path: str | Path) -> int:
    """The context when the user names none: DEFAULT_CONTEXT, or the model's maximum where that is smaller."""
    from ..formats.source import read_config

    return min(DEFAULT_CONTEXT, read_config(model_path).max_position_embeddings)


__all__ = ["Budgets", "ModelInfo", "Plan", "PlanRequest", "check", "default_context_tokens", "detect_budgets",
           "inspect", "max_context", "plan", "plan_for"]
