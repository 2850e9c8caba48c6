"""The generic MoE block: router linear -> the family's `route` -> ExpertRuntime.forward (routed
experts, wherever they live) -> + optional shared expert (with its sigmoid gate). Knows nothing
of caches or placement; the routed experts' weights are not model parameters. softmax_topk, the
route most families share, is one fused kernel on cuda (fused_router.py); sigmoid_group_topk
(glm4_moe, deepseek_v3), softmax_group_topk (deepseek_v2) and softmax_bias_topk (ernie4_5_moe)
are torch on every device, the fused kernel never sees them.

Shape legend: T tokens, E experts, K routed experts per token, D hidden, Is shared expert width.
"""
import torch
import torch.nn.functional as F
from torch import nn

from . import fused, fused_router
from .layers import Linear


def softmax_topk(router_logits: torch.Tensor, k: int, renormalize: bool):
    """Softmax over all experts in fp32, then the top k probabilities in descending order,
    renormalised to sum 1 when asked. -> (expert_ids [T, K] int64, weights [T, K] fp32).
    On cuda with Triton (fused.enabled) one kernel does it all (fused_router.softmax_topk; ties go to
    the lower expert id); elsewhere torch's softmax and topk (which orders ties as it likes)."""
    if fused.enabled(router_logits):
        return fused_router.softmax_topk(router_logits, k, renormalize)
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    weights, expert_ids = torch.topk(probs, k, dim=-1)  # [T, K]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return expert_ids, weights


def sigmoid_group_topk(router_logits: torch.Tensor, bias: torch.Tensor, k: int, num_groups: int,
                       num_topk_groups: int, renormalize: bool, scale: float):
    """Sigmoid scores s in fp32; experts are chosen by s + bias (the correction bias [E]) but
    weighted by s. With groups: the E experts form num_groups groups of E / num_groups in id
    order, each group is ranked by the sum of its two best s + bias, and a token takes its k
    experts from its num_topk_groups best groups only. Weights renormalised to sum 1 when asked
    (+1e-20, as transformers), then times scale. -> (expert_ids [T, K] int64, weights [T, K] fp32).
    Example: E=8, 4 groups {0,1} {2,3} {4,5} {6,7}, num_topk_groups=2, s + bias =
    [.9 .1 | .5 .5 | .8 .0 | .2 .3]: group sums 1.0, 1.0, 0.8, 0.5 keep {0,1} and {2,3}; k=2
    takes experts 0 and then 2 or 3 (a tie), never 4 although .8 > .5."""
    scores = torch.sigmoid(router_logits.float())  # [T, E]
    choice = scores + bias.float()  # [T, E]
    if num_topk_groups < num_groups:
        T, E = choice.shape
        grouped = choice.view(T, num_groups, E // num_groups)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        kept = torch.topk(group_scores, num_topk_groups, dim=-1).indices  # [T, Gk]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # [T, G]
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(T, E)
    expert_ids = torch.topk(choice, k, dim=-1).indices  # [T, K]
    weights = scores.gather(1, expert_ids)  # [T, K]
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return expert_ids, weights * scale


def softmax_group_topk(router_logits: torch.Tensor, k: int, num_groups: int,
                       num_topk_groups: int, scale: float):
    """deepseek_v2's route: softmax over all experts in fp32; with groups (group_limited_greedy)
    the E experts form num_groups groups of E / num_groups in id order, each ranked by its best
    probability, and a token takes its k experts from its num_topk_groups best groups only;
    else (greedy) the top k of all. Weights: the probabilities, never renormalised, times scale.
    -> (expert_ids [T, K] int64, weights [T, K] fp32)."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    if num_topk_groups < num_groups:
        T, E = probs.shape
        grouped = probs.view(T, num_groups, E // num_groups)  # [T, G, E/G]
        kept = torch.topk(grouped.amax(dim=-1), num_topk_groups, dim=-1).indices  # [T, Gk]
        keep = torch.zeros(T, num_groups, dtype=torch.bool, device=probs.device)
        keep.scatter_(1, kept, True)  # [T, G]
        probs = grouped.masked_fill(~keep[:, :, None], 0.0).view(T, E)
    weights, expert_ids = torch.topk(probs, k, dim=-1)  # [T, K]
    return expert_ids, weights * scale


def softmax_bias_topk(router_logits: torch.Tensor, bias: torch.Tensor, k: int, norm_min: float):
    """ernie4_5_moe's route: softmax p over all experts in fp32; experts chosen by p + bias (the
    correction bias, any shape holding E values) but weighted by p, divided by max(their sum,
    norm_min). -> (expert_ids [T, K] int64, weights [T, K] fp32).
    Example: p = [.5 .3 .2], bias = [0 0 .4], k=2: p + bias = [.5 .3 .6] takes experts 2 and 0,
    weights [.2 .5] / .7."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    expert_ids = torch.topk(probs + bias.float().reshape(-1), k, dim=-1).indices  # [T, K]
    weights = probs.gather(1, expert_ids)  # [T, K]
    return expert_ids, weights / weights.sum(dim=-1, keepdim=True).clamp(min=norm_min)


class MoEBlock(nn.Module):
    """Subclass per family and define `route(router_logits [T, E]) -> (expert_ids [T, K] int64,
    weights [T, K] fp32)`; everything else is shared."""

    def __init__(self, config):
        super().__init__()
        c = config
        self.config = c
        self.ffn_gate_inp = Linear(c.hidden_size, c.num_experts, bias=False)  # router
        self.has_shared_expert = c.shared_expert_intermediate_size > 0
        if self.has_shared_expert:
            inter = c.shared_expert_intermediate_size
            self.ffn_gate_shexp = Linear(c.hidden_size, inter, bias=False)
            self.ffn_up_shexp = Linear(c.hidden_size, inter, bias=False)
            self.ffn_down_shexp = Linear(inter, c.hidden_size, bias=False)
            if c.shared_expert_gate:
                self.ffn_gate_inp_shexp = Linear(c.hidden_size, 1, bias=False)

    def route(self, router_logits: torch.Tensor):
        raise NotImplementedError

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, E]: the router linear in x's dtype (a family may compute it in fp32)."""
        return self.ffn_gate_inp(x)

    def forward(self, x: torch.Tensor, layer: int, step) -> torch.Tensor:
        """x [T, D] -> [T, D]."""
        expert_ids, weights = self.route(self.router_logits(x))  # [T, K] x2
        out = step.experts.forward(layer, x, expert_ids, weights)  # [T, D]
        if self.has_shared_expert:
            shared = self.ffn_down_shexp(F.silu(self.ffn_gate_shexp(x)) * self.ffn_up_shexp(x))
            if self.config.shared_expert_gate:
                shared = torch.sigmoid(self.ffn_gate_inp_shexp(x)) * shared
            out = out + shared
        return out
