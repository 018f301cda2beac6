"""From a model folder and a context size to LoadOptions: the plan decides where each layer goes."""

from __future__ import annotations

from pathlib import Path

from .budgets import detect_budgets
from .engine import LoadOptions
from .inspect import inspect
from .planner import PlanRequest, check


def load_options_for(model_dir: Path, context_tokens: int, *, dtype: str | None = None,
                     kv_dtype: str | None = None, gpu_layers: int | None = None) -> LoadOptions:
    """Plan against this machine's budgets; raises InsufficientMemoryError before anything is allocated."""
    request = PlanRequest(context_tokens=context_tokens, dtype=dtype, kv_dtype=kv_dtype, gpu_layers=gpu_layers)
    return check(inspect(model_dir), request, detect_budgets()).load_options()
