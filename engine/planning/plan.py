"""The memory plan: the KV cache for the chosen context first, then layers onto the GPUs while they fit, the rest on the CPU.

A model of experts is placed finer (docs/moe.md): every layer's attention, KV cache, router and dense parts first,
then the experts of as many whole layers as fit, each with its own layer, the rest on the CPU.

`plan()` is a pure function of a ModelInfo, a PlanRequest and Budgets: it allocates nothing, so the
GUI calls it on every slider move. A plan that does not fit is still returned (`fits=False`, with
the error text) so the GUI can draw it; `Plan.require_fit()` (or `check()`) raises instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from stowage.kernels import attention_ops

from ..dtypes import COMPUTE, kv_dtypes
from ..errors import InsufficientMemoryError
from ..plan_request import PlanRequest  # noqa: F401 (the planner's input, imported from here too)
from ..units import format_bytes
from .budgets import Budgets, DeviceBudget, DiskBudget, default_kv_disk_budget
from .inspect import ModelInfo
from .workspace import Workspace, device_workspace


@dataclass(frozen=True)
class DevicePlan:
    """What one device holds under a plan, in bytes."""

    device: str  # "cuda:0", ... or "cpu"
    name: str
    layers: tuple[int, ...]
    weights_bytes: int  # whole tensors: its layers' and any non-layer tensors placed here
    kv_bytes: int
    workspace: Workspace
    budget_bytes: int  # usable: free minus reserve_bytes (and capped by a RAM limit)
    reserve_bytes: int
    holds: tuple[str, ...] = ()  # non-layer tensors placed here: "embed", "norm", "lm_head"
    attention: str = ""  # the attention implementation its layers run (kernels.attention_ops(device).NAME)
    experts: tuple[int, ...] = ()  # the layers whose experts are here (a model of experts)
    expert_bytes: int = 0  # of weights_bytes, those experts'
    read_bytes_per_token: int = 0  # weight bytes one decode token reads here: its chosen experts only, docs/moe.md

    @property
    def other_weights_bytes(self) -> int:
        """Weights that are not experts: attention, norms, routers, dense MLPs, embeddings, head."""
        return self.weights_bytes - self.expert_bytes

    @property
    def workspace_bytes(self) -> int:
        return self.workspace.total_bytes

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.workspace_bytes

    @property
    def headroom_bytes(self) -> int:
        """Budget left over; negative when the device is over its budget."""
        return self.budget_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget_bytes

    @property
    def label(self) -> str:
        return f"GPU {self.device.removeprefix('cuda:')}" if self.device.startswith("cuda") else "RAM"


@dataclass(frozen=True)
class Plan:
    """Where every layer, tensor and KV block goes, and what each device is left with."""

    fits: bool
    error: str | None
    request: PlanRequest
    context_tokens: int
    max_context_tokens: int  # the largest context that fits with the same settings (0: none)
    num_layers: int
    max_position_embeddings: int
    dtype: str  # the compute dtype
    kv_dtype: str
    block_size: int
    prefill_chunk: int  # the requested chunk, at most the context
    devices: tuple[DevicePlan, ...]  # GPUs in order, then the CPU
    layer_devices: tuple[str, ...]  # each layer's attention, KV cache, router and dense parts
    embed_device: str
    head_device: str
    note: str = ""
    model_name: str = field(default="", compare=False)
    kv_disk_bytes: int = 0  # the budget of evicted conversations' K/V on disk (engine/serving/kv_store.py); 0: none
    kv_disk_free_bytes: int = 0  # free space on the disk of kv_dir when planned
    kv_dir: str = ""  # where they are written
    expert_devices: tuple[str, ...] = ()  # each layer's experts (docs/moe.md); its own device for a dense layer

    def device(self, name: str) -> DevicePlan:
        return next(d for d in self.devices if d.device == name)

    @property
    def kv_bytes(self) -> int:
        return sum(d.kv_bytes for d in self.devices)

    @property
    def num_gpu_layers(self) -> int:
        return sum(1 for d in self.layer_devices if d != "cpu")

    @property
    def num_expert_layers(self) -> int:
        """Layers that route through experts (0: a dense model)."""
        return sum(1 for d in self.devices for _ in d.experts)

    def require_fit(self) -> "Plan":
        """This plan if it fits; otherwise raise InsufficientMemoryError with the plan's error text."""
        if not self.fits:
            raise InsufficientMemoryError(self.error)
        return self

    @property
    def num_seqs(self) -> int:
        return self.request.num_seqs

    @property
    def forced_dtype(self) -> str | None:
        """The dtype the weights are converted to (None: used as stored)."""
        return self.request.dtype


class _Costs:
    """The per-plan constants, worked out once so a max_context search only redoes the placement."""

    def __init__(self, info: ModelInfo, request: PlanRequest):
        self.info, self.request = info, request
        self.dtype_name = request.dtype or info.compute_dtype
        self.dtype = COMPUTE[self.dtype_name]
        self.kv_dtype = request.kv_dtype or self.dtype_name
        self.kv_spec = info.kv_spec(self.kv_dtype, request.block_size)
        self.chunk = request.prefill_chunk
        self.layer_bytes = info.layer_bytes(request.dtype)  # a layer without its experts
        self.expert_bytes = info.expert_bytes(request.dtype)
        config = info.config
        # what a decode token reads of a layer's experts: its num_experts_per_tok of num_experts
        self.active = (config.num_experts_per_tok, config.num_experts) if config.is_moe else (1, 1)
        self.embed_bytes = info.embed.nbytes(request.dtype)
        self.norm_bytes = info.norm.nbytes(request.dtype)
        self.lm_head_bytes = info.lm_head.nbytes(request.dtype)
        self.embed_row_bytes = self.embed_bytes // info.layout.num_embeddings  # what a token's lookup reads
        self.windows = info.config.layer_windows or (None,) * info.num_layers

    def kv_bytes(self, context_tokens: int) -> tuple[int, ...]:
        """Each layer's KV cache: the whole context, or what its sliding window and a prefill chunk reach (the
        blocks KVCache keeps for it, from the same CacheSpec)."""
        chunk, num_seqs = min(self.chunk, context_tokens), self.request.num_seqs
        return tuple(self.kv_spec.layer_bytes(context_tokens, num_seqs, window=w, chunk=chunk) for w in self.windows)

    def head_bytes(self, device: str, embed_device: str) -> int:
        # tied: the head is the embedding tensor, already counted where the embedding lives
        shared = self.info.tied_embeddings and device == embed_device
        return self.norm_bytes + (0 if shared else self.lm_head_bytes)

    def workspace(self, device: str, context_tokens: int, *, runs_layers: bool, holds_head: bool,
                  holds_embed: bool, runs_experts: bool = False) -> Workspace:
        return device_workspace(
            self.info.config, attention_ops(device), device_type="cuda" if device.startswith("cuda") else "cpu",
            runs_layers=runs_layers, holds_head=holds_head, holds_embed=holds_embed, runs_experts=runs_experts,
            context_tokens=context_tokens,
            chunk=self.chunk, dtype=self.dtype, cache_dtype=kv_dtypes(self.kv_dtype)[0], block_size=self.request.block_size,
            num_seqs=self.request.num_seqs, matrices=self.info.matrices, converts=self.request.dtype is not None)


EMBED_DEVICE = "cpu"  # an embedding lookup reads one row per token: it costs no VRAM and no speed on the CPU


def _place(costs: _Costs, budgets: Budgets, context_tokens: int, gpu_layers: int | None) -> tuple[DevicePlan, ...]:
    """Layers onto the GPUs from the first while each fits with its KV; the rest, the embedding, and a last
    layer that would not fit with the head onto the CPU. `gpu_layers` fixes the count (overflowing the last GPU).

    A layer here is everything of it but its experts; those follow, a whole layer's at a time (_place_experts)."""
    num_layers = len(costs.layer_bytes)
    kv = costs.kv_bytes(context_tokens)
    gpus = budgets.gpus if gpu_layers != 0 else ()
    wanted = num_layers if gpu_layers is None else min(gpu_layers, num_layers)
    # every GPU runs the same kind of layer, so its workspace is the same but for the head's logits
    ws_body, ws_last = (costs.workspace(gpus[0].device if gpus else "cuda:0", context_tokens, runs_layers=True, holds_head=h, holds_embed=False)
                        .total_bytes for h in (False, True))
    assigned: list[list[int]] = []
    used_by: list[int] = []
    layer = 0
    for g, gpu in enumerate(gpus):
        mine: list[int] = []
        used = 0
        overflow_ok = gpu_layers is not None and g == len(gpus) - 1
        while layer < wanted:
            holds_head = layer == num_layers - 1
            ws = ws_last if holds_head else ws_body
            head = costs.head_bytes(gpu.device, EMBED_DEVICE) if holds_head else 0
            need = costs.layer_bytes[layer] + kv[layer] + head
            if used + need + ws > gpu.budget_bytes and not overflow_ok:
                break
            mine.append(layer)
            used += need
            layer += 1
        assigned.append(mine)
        used_by.append(used + (ws_last if mine and mine[-1] == num_layers - 1 else ws_body))
    cpu_layers = list(range(layer, num_layers))
    gpu_experts = _place_experts(costs, [g.budget_bytes for g in gpus], assigned, used_by)
    cpu_experts = [i for i in range(num_layers) if costs.expert_bytes[i] and not any(i in e for e in gpu_experts)]
    plans = [_device_plan(costs, gpu, tuple(mine), kv, context_tokens, num_layers, tuple(experts))
             for gpu, mine, experts in zip(gpus, assigned, gpu_experts)]
    plans += [_device_plan(costs, gpu, (), kv, context_tokens, num_layers) for gpu in budgets.gpus[len(gpus):]]
    plans.append(_device_plan(costs, budgets.ram, tuple(cpu_layers), kv, context_tokens, num_layers,
                              tuple(cpu_experts)))
    return tuple(plans)


def _place_experts(costs: _Costs, budgets: list[int], assigned: list[list[int]], used_by: list[int]) -> list[list[int]]:
    """The layers whose experts go on each GPU, beside their own layer (never where the layer is not).

    Auto: in layer order, each GPU takes its layers' experts while they fit in what the layers left (the workspace
    included), stopping at the first that does not. `cpu_expert_layers` N instead keeps the last N layers' experts
    on the CPU and puts every other GPU layer's with it, fitting or not (the plan then says it does not fit)."""
    forced = costs.request.cpu_expert_layers
    routed = [i for i in range(len(costs.expert_bytes)) if costs.expert_bytes[i]]
    kept = set(routed[max(0, len(routed) - forced):]) if forced else set()  # N past the layers: all of them
    out = []
    for budget, mine, used in zip(budgets, assigned, used_by):
        experts = []
        for layer in (i for i in mine if costs.expert_bytes[i]):
            if forced is not None:
                if layer not in kept:
                    experts.append(layer)
                continue
            if used + costs.expert_bytes[layer] > budget:
                break
            experts.append(layer)
            used += costs.expert_bytes[layer]
        out.append(experts)
    return out


def _device_plan(costs: _Costs, budget: DeviceBudget, layers: tuple[int, ...], kv: tuple[int, ...],
                 context_tokens: int, num_layers: int, experts: tuple[int, ...] = ()) -> DevicePlan:
    holds_head = bool(layers) and layers[-1] == num_layers - 1
    holds_embed = budget.device == EMBED_DEVICE
    holds = (("embed",) if holds_embed else ()) + (("norm", "lm_head") if holds_head else ())
    head = costs.head_bytes(budget.device, EMBED_DEVICE) if holds_head else 0
    layer_weights = sum(costs.layer_bytes[i] for i in layers)
    expert_bytes = sum(costs.expert_bytes[i] for i in experts)
    weights = layer_weights + expert_bytes + head + (costs.embed_bytes if holds_embed else 0)
    k, num_experts = costs.active
    # a decode token reads every weight of its layers, its k experts of each layer's, the whole head, one embedding row
    read = layer_weights + expert_bytes * k // num_experts + head + (costs.embed_row_bytes if holds_embed else 0)
    ws = costs.workspace(budget.device, context_tokens, runs_layers=bool(layers), holds_head=holds_head,
                         holds_embed=holds_embed, runs_experts=bool(experts))
    kv_bytes = sum(kv[i] for i in layers)
    return DevicePlan(budget.device, budget.name, layers, weights, kv_bytes, ws, budget.budget_bytes,
                      budget.reserve_bytes, holds, attention_ops(budget.device).NAME if layers else "",
                      experts, expert_bytes, read)


def _fits(devices: tuple[DevicePlan, ...]) -> bool:
    return all(d.fits for d in devices)


def _max_context(costs: _Costs, budgets: Budgets) -> int:
    block, limit, gpu_layers = costs.request.block_size, costs.info.max_position_embeddings, costs.request.gpu_layers

    def fits(tokens: int) -> bool:
        if gpu_layers and not budgets.gpus:
            return False
        return _fits(_place(costs, budgets, tokens, gpu_layers))

    if fits(limit):
        return limit
    # Every term rises with the context, so fitting is monotone: bisect on whole blocks.
    # Invariant: lo == 0 or lo blocks fit; hi blocks do not fit (or reach the limit, which does not fit).
    lo, hi = 0, -(-limit // block)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * block):
            lo = mid
        else:
            hi = mid
    return lo * block


def max_context(info: ModelInfo, request: PlanRequest, budgets: Budgets) -> int:
    """The largest context (a whole number of blocks, at most max_position_embeddings) that fits; 0 if none."""
    return _max_context(_Costs(info, request), budgets)


def plan(info: ModelInfo, request: PlanRequest, budgets: Budgets) -> Plan:
    """Place the KV cache, layers and non-layer tensors on the devices; never raises for lack of memory."""
    costs = _Costs(info, request)
    context_tokens = request.context_tokens
    devices = _place(costs, budgets, context_tokens, request.gpu_layers)
    largest = _max_context(costs, budgets)
    layer_devices = ["cpu"] * info.num_layers
    for d in devices:
        for i in d.layers:
            layer_devices[i] = d.device
    expert_devices = list(layer_devices)  # a dense layer's: its own
    for d in devices:
        for i in d.experts:
            expert_devices[i] = d.device
    fits = _fits(devices) and context_tokens <= info.max_position_embeddings
    if request.gpu_layers and not budgets.gpus:
        fits = False
    result = Plan(
        fits=fits, error=None, request=request, context_tokens=context_tokens, max_context_tokens=largest,
        num_layers=info.num_layers, max_position_embeddings=info.max_position_embeddings, dtype=costs.dtype_name,
        kv_dtype=costs.kv_dtype, block_size=request.block_size,
        prefill_chunk=min(request.prefill_chunk, context_tokens),
        devices=devices, layer_devices=tuple(layer_devices), embed_device=EMBED_DEVICE,
        head_device=layer_devices[-1], note=budgets.note, model_name=info.model_dir.name,
        expert_devices=tuple(expert_devices), **_kv_disk(request, budgets.disk),
    )
    if fits:
        return result
    auto = _place(costs, budgets, context_tokens, None) if request.gpu_layers else devices
    max_gpu_layers = sum(len(d.layers) for d in auto if d.device != "cpu")
    reference = _place(costs, budgets, largest, request.gpu_layers) if largest else devices
    return replace(result, error=error_text(result, budgets, reference, max_gpu_layers))


def _kv_disk(request: PlanRequest, disk: DiskBudget | None) -> dict:
    """The spill budget: as asked (default min(4 GiB, 10% free)), never more than the disk has free."""
    if disk is None:
        return {}
    wanted = default_kv_disk_budget(disk.free_bytes) if request.kv_disk_budget is None else request.kv_disk_budget
    return {"kv_disk_bytes": min(wanted, disk.free_bytes), "kv_disk_free_bytes": disk.free_bytes,
            "kv_dir": disk.folder}


def check(info: ModelInfo, request: PlanRequest, budgets: Budgets) -> Plan:
    """plan(), raising InsufficientMemoryError when the request does not fit."""
    return plan(info, request, budgets).require_fit()


def error_text(plan: Plan, budgets: Budgets, reference: tuple, max_gpu_layers: int) -> str:
    """Why a plan does not fit: what it needs, what each device has, the largest context that fits, what to do.

    `reference`: the device plans of the largest context that fits (this plan's own when none does).
    """
    request, context_tokens = plan.request, plan.context_tokens
    limit = plan.max_position_embeddings
    clauses: list[str] = []
    advice: list[str] = []
    if context_tokens > limit:
        clauses.append(f"a {context_tokens:,}-token context is longer than the model's {limit:,} positions "
                       "(max_position_embeddings in config.json)")
        advice.append(f"at most {limit:,} tokens")
    elif request.gpu_layers and not budgets.gpus:
        clauses.append(f"{request.gpu_layers} GPU layers were asked for, but there is no GPU ({budgets.note})")
        advice.append("plan for the CPU alone (GPU layers: 0, or auto)")
    else:
        # What is left for the cache once the weights sit where they would for the largest context that fits
        # (or, when none fits, where this request put them).
        left = [(d.label, max(0, d.budget_bytes - d.weights_bytes - d.workspace_bytes))
                for d in reference if d.layers or d.budget_bytes]
        where = " and ".join(format_bytes(n) + (" in RAM" if label == "RAM" else f" on {label}") for label, n in left)
        clauses.append(f"a {context_tokens:,}-token context needs {format_bytes(plan.kv_bytes)} of KV cache "
                       f"({plan.kv_dtype}); after the weights and workspace, "
                       f"{format_bytes(sum(n for _, n in left))} is left for it"
                       + (f": {where}" if len(left) > 1 else f" {where.split(' ', 2)[2]}"))
        by_device = {b.device: b for b in budgets.devices}
        for d in plan.devices:
            if not d.fits:
                clauses.append(f"{d.label} would hold {format_bytes(d.total_bytes)} ({format_bytes(d.weights_bytes)} "
                               f"weights, {format_bytes(d.kv_bytes)} KV cache, {format_bytes(d.workspace_bytes)} "
                               f"workspace) but has {by_device[d.device].describe()}")
        advice.append("a shorter context")
        if plan.kv_dtype != "q4_0":
            advice.append("a smaller KV dtype (fp8 takes 1 byte per value, q8_0 1.06, q4_0 0.56)")
        if request.gpu_layers and any(not d.fits for d in plan.devices if d.device != "cpu"):
            advice.append(f"fewer GPU layers (at most {max_gpu_layers} fit with this context)")
        if not plan.device("cpu").fits:
            advice.append("more free RAM (close programs, or raise the RAM budget or limit; "
                          "Stowage never plans into swap)")
    if plan.max_context_tokens:
        clauses.append(f"the largest context that fits is {plan.max_context_tokens:,} tokens")
    else:
        clauses.append("no context fits: the weights and workspace alone exceed the memory available")
        advice.append("a smaller weights dtype or more memory")
    return "; ".join(clauses) + ". Choose " + _or(advice) + "."


def _or(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]
