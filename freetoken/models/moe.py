"""The generic MoE block: router linear -> the family's `route` -> ExpertRuntime.forward (routed
experts, wherever they live) -> + optional shared expert (with its sigmoid gate). Knows nothing
of caches or placement; the routed experts' weights are not model parameters. softmax_topk, the
route most families share, is one fused kernel on cuda (fused_router.py).

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

    def forward(self, x: torch.Tensor, layer: int, step) -> torch.Tensor:
        """x [T, D] -> [T, D]."""
        expert_ids, weights = self.route(self.ffn_gate_inp(x))  # [T, K] x2
        out = step.experts.forward(layer, x, expert_ids, weights)  # [T, D]
        if self.has_shared_expert:
            shared = self.ffn_down_shexp(F.silu(self.ffn_gate_shexp(x)) * self.ffn_up_shexp(x))
            if self.config.shared_expert_gate:
                shared = torch.sigmoid(self.ffn_gate_inp_shexp(x)) * shared
            out = out + shared
        return out
