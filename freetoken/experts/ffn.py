"""The math of one routed expert, runs of routes through device experts (run_expert_runs: the
device tier's slot path; run_stacked_layer: streamed prefill layers) and the grouping of
routes by expert, shared by every ExpertRuntime (reference, device tier, CPU executor). Owns
no state and no placement.

Shape legend: T tokens, K routes per token, R = T*K routes, D hidden, I expert hidden.
"""
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ModelError
from ..kernel_args import SILU, ExpertAct
from .compute import grouped_experts


def check_act(model_config) -> ExpertAct:
    """The ExpertAct of a ModelConfig's experts; ModelError for one the runtimes cannot run."""
    if model_config.hidden_act != "silu" or model_config.expert_act not in ("silu", "clamped_swiglu"):
        raise ModelError(f"expert activation {model_config.hidden_act!r} / "
                         f"{model_config.expert_act!r} is not supported (silu, clamped_swiglu); "
                         "re-convert the model with this version of `freetoken convert`")
    return ExpertAct.from_config(model_config)


class ExpertWeights(NamedTuple):
    """One expert's projections (gate/up [I, D], down [D, I]) and, in a biased bank, its
    biases (gate/up [I], down [D]; else None). Stacked views ([E, ...]) read alike."""
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_bias: Optional[torch.Tensor] = None
    up_bias: Optional[torch.Tensor] = None
    down_bias: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, views: dict, index=None) -> "ExpertWeights":
        """From slot_views / pool_views' dict (index: one slot of pool views)."""
        pick = (lambda v: v) if index is None else (lambda v: v[index])
        return cls(*(pick(views[n]) if n in views else None for n in cls._fields))

    def to(self, **kw) -> "ExpertWeights":
        return ExpertWeights(*(None if w is None else w.to(**kw) for w in self))


def activate(g: torch.Tensor, u: torch.Tensor, act: ExpertAct = SILU) -> torch.Tensor:
    """h from the gate and up outputs (ExpertAct): silu(g) * u, or the clamped SwiGLU."""
    if act.name == "clamped_swiglu":
        g = g.clamp(max=act.limit)
        u = u.clamp(-act.limit, act.limit)
        return g * torch.sigmoid(g * act.alpha) * (u + 1)
    return F.silu(g) * u


def expert_ffn(x: torch.Tensor, w: ExpertWeights, act: ExpertAct = SILU) -> torch.Tensor:
    """down(act(gate x + b_g, up x + b_u)) + b_d: x [n, D] -> [n, D], x's dtype; weights cast
    to x's dtype here when they differ."""
    if w.gate.dtype != x.dtype:
        w = w.to(dtype=x.dtype)
    h = activate(F.linear(x, w.gate, w.gate_bias), F.linear(x, w.up, w.up_bias), act)
    return F.linear(h, w.down, w.down_bias)


class Groups(NamedTuple):
    """Routes sorted by expert (see group_routes). CPU tensors; lists are plain Python."""
    experts: list              # [U] distinct routed experts, ascending
    counts: list               # [U] routes of each expert
    token_ids: torch.Tensor    # [R] int64, grouped order: token of each route
    route_ids: torch.Tensor    # [R] int64, grouped order: route index t*K + k
    expert_index: np.ndarray   # [R] int64, grouped order: j such that the route's expert is experts[j]


def group_routes(expert_ids) -> Groups:
    """Sort the R = T*K routes of expert_ids [T, K] (a CPU tensor or numpy array; a device
    tensor is copied here, one sync) by expert, stably (numpy: this runs once per layer step on
    a few hundred ints at most in decode, where torch's per-op cost dominates).

    Example (K=2): expert_ids [[3, 1], [1, 0]] -> flat [3, 1, 1, 0]; experts [0, 1, 3],
    counts [1, 2, 1], route_ids [3, 1, 2, 0], token_ids [1, 0, 1, 0], expert_index [0, 1, 1, 2].
    """
    K = expert_ids.shape[1]
    if isinstance(expert_ids, torch.Tensor):
        expert_ids = expert_ids.cpu().numpy()
    flat = np.ascontiguousarray(expert_ids, dtype=np.int64).reshape(-1)  # [R]
    route_ids = np.argsort(flat, kind="stable")  # [R]
    ordered = flat[route_ids]
    is_new = np.empty(len(ordered), dtype=bool)
    is_new[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=is_new[1:])
    starts = np.flatnonzero(is_new)  # [U]
    counts = np.diff(np.append(starts, len(ordered)))
    expert_index = np.cumsum(is_new) - 1  # [R]
    return Groups(ordered[starts].tolist(), counts.tolist(),
                  torch.from_numpy(route_ids // K), torch.from_numpy(route_ids), expert_index)


def group_routes_on_device(expert_ids: torch.Tensor, num_experts: int, order: bool = True):
    """(idx [2, R] int64: token and route id of each route, grouped by expert, stably, on
    expert_ids' device -- None when not `order` --, route counts per expert numpy [E] (the one
    sync), the same counts on the device). group_routes' grouping without moving the routes to
    the host (many-token layers)."""
    K = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)  # [R]
    idx = None
    if order:
        route_ids = torch.argsort(flat, stable=True)  # [R]
        idx = torch.stack([route_ids // K, route_ids])
    counts_d = torch.bincount(flat, minlength=num_experts)
    return idx, counts_d.cpu().numpy(), counts_d


def run_expert_runs(x, idx, w_flat, out, runs, dtype, fill_done=None, first_fill=None,
                    max_routes=4096, act=SILU, quant=None):
    """out[tok] += w_flat[rid] * expert(x[tok]) (fp32) for runs [(ExpertWeights, or a (gate,
    up, down) tuple, n)]: the
    next n routes of idx [2, R'] (row 0 tokens, row 1 route ids, on x's device) go to the expert
    with these weights (bank dtype; cast to dtype when it differs). Per chunk of at most max_routes routes (whole runs): one
    gather of x, the experts' matmuls writing into one [n, D] buffer, one weighted index_add
    (same additions, in the same order, as one index_add per expert). On cuda the compute
    stream waits for fill_done before run number first_fill (the fresh fills). On cuda with
    Triton (grouped_experts.chosen), each chunk of at most GROUPED_MAX_ROUTES
    routes is two grouped kernels instead of the per-expert matmuls. quant: the bank's
    compute.quant_blocks.QuantSpec (the weights each projection's bytes), which the grouped
    kernels alone read: ValueError elsewhere."""
    if grouped_experts.chosen(x, runs, quant):
        _grouped_runs(x.contiguous(), idx, w_flat, out, runs, fill_done, first_fill, act, quant)
        return
    _refuse_quant(quant, x)
    for i, j, a, n_chunk in _chunks([n for _, n in runs], max_routes):
        tok, rid = idx[0, a:a + n_chunk], idx[1, a:a + n_chunk]  # [n_chunk]
        xs = x.index_select(0, tok)  # [n_chunk, D]
        y = torch.empty_like(xs)
        b = 0
        for k in range(i, j):
            if k == first_fill and fill_done is not None:
                torch.cuda.current_stream(x.device).wait_event(fill_done)
            w, n = runs[k]
            w = w if isinstance(w, ExpertWeights) else ExpertWeights(*w)  # (gate, up, down)
            if w.gate.dtype != dtype:
                w = w.to(dtype=dtype)
            xe = xs[b:b + n]
            h = activate(F.linear(xe, w.gate, w.gate_bias), F.linear(xe, w.up, w.up_bias), act)  # [n, I]
            torch.mm(h, w.down.t(), out=y[b:b + n])  # down(h): [n, D]
            if w.down_bias is not None:
                y[b:b + n] += w.down_bias
            b += n
        out.index_add_(0, tok, y.float() * w_flat.index_select(0, rid)[:, None])


GROUPED_MAX_ROUTES = 16384  # routes per grouped call: its fp32 [R', D] output (134 MB at D 2048)


def run_stacked_layer(x, idx, w_flat, out, stacks, counts, counts_d, act=SILU, quant=None):
    """out[tok] += w_flat[rid] * expert(x[tok]) (fp32) for every route of a layer whose experts
    are stacks (ExpertWeights of [E, ...] views: a streamed layer buffer's,
    grouped_experts.chosen_stacks), idx [2, R] grouped by expert with counts [E] (numpy) and
    counts_d (the same on the device): grouped_experts.run_stacked per chunk of whole experts
    of at most GROUPED_MAX_ROUTES routes, one index_add each. quant: as run_expert_runs'
    (the stacks [E, nbytes] uint8)."""
    x = x.contiguous()
    for e0, e1, a, n in _chunks(counts.tolist(), GROUPED_MAX_ROUTES):
        if n:
            tok, rid = idx[0, a:a + n], idx[1, a:a + n]
            n_tiles = int((-(-counts[e0:e1] // grouped_experts.BM)).sum())
            out.index_add_(0, tok, grouped_experts.run_stacked(
                x, tok, rid, w_flat, stacks, e0, counts_d[e0:e1], n_tiles, act, quant))


def _refuse_quant(quant, x) -> None:
    if quant is not None:
        raise ValueError(f"{quant.quant} experts on the device run through the grouped Triton "
                         f"kernels only (cuda with Triton), not on {x.device}")


def _grouped_runs(x, idx, w_flat, out, runs, fill_done, first_fill, act=SILU, quant=None):
    """run_expert_runs through grouped_experts.run: chunks of whole runs, the fills' runs (from
    first_fill on) after the compute stream waits for fill_done."""
    wait_at = first_fill if fill_done is not None else None
    for i, j, a, n_chunk in _chunks([n for _, n in runs], GROUPED_MAX_ROUTES, wait_at):
        if i == wait_at:
            torch.cuda.current_stream(x.device).wait_event(fill_done)
        tok, rid = idx[0, a:a + n_chunk], idx[1, a:a + n_chunk]
        out.index_add_(0, tok, grouped_experts.run(x, tok, rid, w_flat, runs[i:j], act, quant))


def _chunks(counts: list, limit: int, cut=None):
    """(i, j, a, n) per chunk of consecutive groups i .. j - 1 of `counts` routes back to back:
    routes a .. a + n, at most `limit` of them unless one group alone has more; no chunk spans
    group `cut` and the one before it. E.g. counts [3, 2, 4], limit 5 -> (0, 2, 0, 5), (2, 3, 5, 4)."""
    i, a = 0, 0
    while i < len(counts):
        stop = cut if cut is not None and i < cut else len(counts)
        j, n = i, 0
        while j < stop and (j == i or n + counts[j] <= limit):
            n += counts[j]
            j += 1
        yield i, j, a, n
        i, a = j, a + n
