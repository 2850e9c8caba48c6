"""Device experts for a fixed number of routes, with no host data: the routes' slots are a
device tensor, so the work can be captured in a CUDA graph and replayed with other slots. One
gather of the routes' slots out of the slot pool, two batched matmuls, one weighted sum. A route
that must not count gets weight 0 (its slot still has to hold finite numbers: the pool is
zero-filled at start, see ExpertCache).

Shape legend: T tokens, K routes per token, R = T*K routes (route r = t*K + k), D hidden,
I expert hidden.
"""
import torch

from . import triton_experts
from .quant_blocks import QuantSpec
from ...kernel_args import SILU
from ..bank import TORCH_DTYPES
from ..ffn import activate


class GatheredExperts:
    """run(layer, x, slots, weights) -> sum_k weights[t, k] * expert(slot[t, k])(x[t]), fp32.
    On cuda with Triton the experts are read in place (triton_experts.py); elsewhere (the cpu
    device, no Triton) the gather below runs, which is also the Triton path's test oracle.
    A quantized bank's slots (QuantSpec) are read by the Triton kernels alone."""

    def __init__(self, storage: torch.Tensor, infos: dict, act=SILU):
        self.storage = storage  # uint8 [C, stride]
        self.infos = infos
        self.act = act  # kernel_args.ExpertAct
        self.layouts = {layer: _layout(info) for layer, info in infos.items()}
        self.quant = {layer: QuantSpec.of(info) for layer, info in infos.items()}
        self.use_triton = storage.is_cuda and triton_experts.available()
        self.typed = {}  # bank dtype -> the pool viewed as that dtype [C, stride / itemsize]

    def run(self, layer: int, x: torch.Tensor, slots: torch.Tensor,
            weights: torch.Tensor, summed: bool = True) -> torch.Tensor:
        """x [T, D] compute dtype; slots [R] int64 and weights [R] fp32, on x's device, route
        order -> fp32 [T, D]; summed False: each route's weighted output, fp32 [R, D] (the
        finish kernel adds them: one kernel less per layer)."""
        if self.use_triton:
            return self._run_triton(layer, x, slots, weights, summed)
        if self.quant[layer] is not None:
            raise ValueError(f"{self.infos[layer].name} holds {self.quant[layer].quant} experts, "
                             "which the device reads through the Triton kernels only (cuda)")
        T, D = x.shape
        R = slots.shape[0]
        dtype, gate_up, gate, up, down, inter, biases = self.layouts[layer]
        w = self.storage.index_select(0, slots)  # [R, stride] uint8: the routes' experts
        xs = x.repeat_interleave(R // T, dim=0) if T > 1 else x.expand(R, D)  # [R, D]
        xs = xs[:, :, None]  # [R, D, 1]; the math in x's dtype, weights cast when they differ
        if gate_up is not None:  # gate and up back to back: one matmul
            gu = torch.bmm(_proj(w, gate_up, dtype, x.dtype), xs)  # [R, 2I, 1]
            g, u = gu[:, :inter], gu[:, inter:]
        else:
            g = torch.bmm(_proj(w, gate, dtype, x.dtype), xs)  # [R, I, 1]
            u = torch.bmm(_proj(w, up, dtype, x.dtype), xs)
        if biases is not None:  # [R, I, 1] x2, [R, D]
            gb, ub, db = (_proj(w, b, dtype, x.dtype) for b in biases)
            g, u = g + gb[:, :, None], u + ub[:, :, None]
        h = activate(g, u, self.act)  # [R, I, 1]
        y = torch.bmm(_proj(w, down, dtype, x.dtype), h)[:, :, 0]  # [R, D]
        if biases is not None:
            y = y + db
        y = y.float() * weights[:, None]
        return y.view(T, R // T, D).sum(dim=1) if summed else y  # [T, D] or [R, D]

    def _run_triton(self, layer, x, slots, weights, summed=True):
        dtype, _, gate, up, down, inter, biases = self.layouts[layer]
        quant = self.quant[layer]
        if quant is not None:  # the slots' bytes, offsets in bytes
            dtype = torch.uint8
        typed = self.typed.get(dtype)
        if typed is None:
            typed = self.typed[dtype] = self.storage.view(dtype)  # [C, stride / itemsize]
        size = typed.element_size()
        offsets = tuple(p[0] // size for p in (gate, up, down, *(biases or ())))
        return triton_experts.run(typed, (offsets, (inter, x.shape[1])), x, slots, weights, summed,
                                  self.act, quant)


def _layout(info):
    """(bank dtype, gate+up span or None, gate, up, down spans, I, the three bias spans or
    None): a span is (offset, nbytes, rows, cols) of a projection inside a slot (a bias: cols 1)."""
    p = {q.name: (q.offset, q.nbytes) + (tuple(q.shape) + (1,))[:2] for q in info.projections}
    gate, up, down = p["gate"], p["up"], p["down"]
    gate_up = None
    if up[0] == gate[0] + gate[1] and up[2:] == gate[2:]:
        gate_up = (gate[0], gate[1] + up[1], gate[2] + up[2], gate[3])
    biases = None
    if "gate_bias" in p:
        biases = tuple(p[n][:3] + (None,) for n in ("gate_bias", "up_bias", "down_bias"))
    return TORCH_DTYPES[info.dtype], gate_up, gate, up, down, gate[2], biases


def _proj(w: torch.Tensor, span, dtype, compute_dtype) -> torch.Tensor:
    """[R, rows, cols] typed view of one projection in gathered slots w uint8 [R, stride] (a
    bias, cols None: [R, rows])."""
    offset, nbytes, rows, cols = span
    shape = (w.shape[0], rows) if cols is None else (w.shape[0], rows, cols)
    v = w[:, offset:offset + nbytes].view(dtype).view(*shape)
    return v if dtype == compute_dtype else v.to(compute_dtype)
