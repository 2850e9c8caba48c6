"""DenseReferenceExperts: the simplest correct ExpertRuntime. Every routed expert is read
straight from the host bank and cast to the compute dtype on the compute device, every step.
No cache, no CPU executor: the oracle that the real runtime is tested against.
"""
import torch

from .bank import TORCH_DTYPES, bank_tensor, expert_slot, slot_views
from .ffn import ExpertWeights, check_act, expert_ffn, group_routes


def resolve_dtype(dtype) -> torch.dtype:
    """A torch dtype from a torch dtype or one of the strings bf16/fp16/fp32."""
    return TORCH_DTYPES[dtype] if isinstance(dtype, str) else dtype


class DenseReferenceExperts:
    """ExpertRuntime contract (docs/INTERFACES.md section 6). `banks`: {layer: HostBank}."""

    def __init__(self, banks: dict, model_config, device, dtype):
        self.act = check_act(model_config)
        self.banks = banks
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype)
        self._bank_tensors = {layer: bank_tensor(b) for layer, b in banks.items()}
        self.stats = {"routes": 0, "steps": 0}
        self.phase = "decode"

    def begin_step(self, phase: str, num_tokens: int) -> None:
        self.phase = phase
        self.stats["steps"] += 1

    def expert_weights(self, layer: int, expert: int) -> ExpertWeights:
        """One expert's weights (and biases), copied to the compute device and dtype."""
        info = self.banks[layer].info
        views = slot_views(expert_slot(self._bank_tensors[layer], info, expert), info)
        return ExpertWeights.of(views).to(device=self.device, dtype=self.dtype)

    def forward(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """x [T, D], expert_ids [T, K] int64, weights [T, K] fp32 -> [T, D] in x's dtype.
        Accumulates in fp32, so the result does not depend on the order of the experts."""
        T, K = expert_ids.shape
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, D]
        w_flat = weights.reshape(-1).to(device=x.device, dtype=torch.float32)  # [R]
        g = group_routes(expert_ids)
        token_ids, route_ids = g.token_ids.to(x.device), g.route_ids.to(x.device)
        start = 0
        for e, n in zip(g.experts, g.counts):
            tok = token_ids[start:start + n]  # [n]
            w = self.expert_weights(layer, e)
            y = expert_ffn(x.index_select(0, tok), w, self.act)  # [n, D]
            out.index_add_(0, tok, y.float() * w_flat[route_ids[start:start + n], None])
            start += n
        self.stats["routes"] += T * K
        return out.to(x.dtype)
