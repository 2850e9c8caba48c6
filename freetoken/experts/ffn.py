"""The math of one routed expert and the grouping of routes by expert, shared by every
ExpertRuntime (reference, device tier, CPU executor). Owns no state and no placement.

Shape legend: T tokens, K routes per token, R = T*K routes, D hidden, I expert hidden.
"""
import torch
import torch.nn.functional as F

from ..errors import ModelError


def check_act(hidden_act: str) -> None:
    if hidden_act != "silu":
        raise ModelError(f"expert activation {hidden_act!r} is not supported (only silu); "
                         "use a model whose hidden_act is silu")


def expert_ffn(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x): x [n, D], gate/up [I, D], down [D, I] -> [n, D], x's dtype."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def group_routes(expert_ids: torch.Tensor):
    """Sort the R = T*K routes by expert. Returns (experts, counts, token_ids, route_ids):
    experts/counts: Python lists of the distinct routed experts (ascending) and their route
    counts; token_ids/route_ids [R] int64 on expert_ids' device, ordered so that the routes
    of experts[j] are the j-th run of length counts[j].

    Example (K=2): expert_ids [[3, 1], [1, 0]] -> flat [3, 1, 1, 0];
    experts [0, 1, 3], counts [1, 2, 1], route_ids [3, 1, 2, 0], token_ids [1, 0, 1, 0].
    """
    T, K = expert_ids.shape
    flat = expert_ids.reshape(-1)  # [R]
    route_ids = torch.argsort(flat, stable=True)  # [R]
    uniq, counts = torch.unique_consecutive(flat[route_ids], return_counts=True)
    token_ids = torch.div(route_ids, K, rounding_mode="floor")  # [R]
    return uniq.tolist(), counts.tolist(), token_ids, route_ids
