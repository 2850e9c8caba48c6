"""Gated DeltaNet, the linear-attention token mixer of the hybrid Qwen families: in projections
-> causal depthwise conv1d (+ SiLU) over q, k, v -> the gated delta rule over a per-head state
-> RMSNorm gated by SiLU(z) -> ssm_out. The per-sequence state (the conv window and the delta
rule's state) lives in state_cache.StateCache, never here. A forward can also copy the state
after some of its tokens (StateSnapshots, Step.snapshots: the states a prefill keeps at anchors,
anchors.py).

The rule runs as torch ops on every device (the chunked form for many tokens, the recurrent form
for one) except on cuda in bf16/fp16 where fla-core is installed (`pip install
"freetoken[cuda]"`): there fla's Triton kernels run it, 8-80x faster than the torch ops at
prefill and 11x at a captured decode step, within bf16 rounding of them (docs/MEASUREMENTS.md,
"Gated DeltaNet: ours against fla"). fp32 (the oracle tests) always takes the torch ops.

The rule, per value head, state S [dk, dv], for each token t (k and q L2-normalised, q scaled by
dk^-1/2, decay g_t <= 0 in log space, beta_t in (0, 1)):
    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t
The chunked form computes the same over L tokens at once (see _chunk).

Shape legend: T tokens, nk key heads, nv value heads (a multiple of nk: each key head serves
nv/nk consecutive value heads), dk/dv key/value head dims, C = 2 nk dk + nv dv conv channels,
K conv kernel width, D hidden.
"""
import functools

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Linear

CHUNK = 64  # tokens per step of the chunked form (the transformers / fla default)


def _named(name: str, *shape) -> nn.Module:
    """A module holding one parameter called `name` (gives canonical names like ssm_dt.bias)."""
    holder = nn.Module()
    holder.register_parameter(name, nn.Parameter(torch.empty(*shape)))
    return holder


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * weight * SiLU(gate) (plain weight, not 1 + w), as transformers: the
    statistics in fp32, the weight multiply in x's dtype, the gate in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return ((self.weight * normed) * F.silu(gate.float())).to(x.dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor,
                keep=()) -> torch.Tensor:
    """SiLU(depthwise causal conv) of x [T, C] continuing from window [C, K-1] (the previous
    K-1 inputs, zeros at the start); window is replaced by the last K-1 inputs. weight [C, 1, K].
    keep: (n, out [C, K-1]) pairs, 0 < n <= T: out gets the window after the first n of the T
    tokens (its last K-1 inputs: for n < K-1 the old window's tail, then x[:n])."""
    T = x.shape[0]
    full = torch.cat((window, x.t().to(window.dtype)), dim=1)  # [C, K-1+T]
    for n, out in keep:
        out.copy_(full[:, n:n + window.shape[1]])
    window.copy_(full[:, T:])
    out = F.conv1d(full[None].to(weight.dtype), weight, groups=weight.shape[0])  # [1, C, T]
    return F.silu(out[0]).t().to(x.dtype)  # [T, C]


def _recurrent(q, k, v, g, beta, state):
    """One token: q, k [nv, dk], v [nv, dv], g, beta [nv] (fp32) -> o [nv, dv]; updates state
    [nv, dk, dv] in place."""
    state.mul_(g.exp()[:, None, None])
    u = beta[:, None] * (v - torch.einsum("hkv,hk->hv", state, k))  # [nv, dv]
    state.add_(k[:, :, None] * u[:, None, :])
    return torch.einsum("hkv,hk->hv", state, q)


def _chunk(q, k, v, g, beta, state):
    """L tokens at once: q, k [nv, L, dk], v [nv, L, dv], g, beta [nv, L] (fp32) -> o [nv, L, dv];
    updates state [nv, dk, dv] in place. With G_t = g_1 + ... + g_t and S0 the state before:
        u = (I + A)^-1 (beta v - beta exp(G) (k S0)),  A[t, j] = beta_t exp(G_t - G_j) k_t.k_j, j < t
        o = exp(G) (q S0) + ((q k^T) * exp(G_t - G_j), j <= t) u
        S = exp(G_L) S0 + (k exp(G_L - G))^T u
    (the per-token rule unrolled over the chunk; the triangular solve is its sequential part)."""
    L = q.shape[1]
    G = g.cumsum(dim=-1)  # [nv, L]
    lower = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()  # j <= t
    decay = (G[:, :, None] - G[:, None, :]).masked_fill(~lower, float("-inf")).exp()  # [nv, L, L]
    A = (k @ k.transpose(1, 2)) * decay * beta[:, :, None]  # the diagonal is ignored below
    rhs = beta[:, :, None] * (v - G.exp()[:, :, None] * (k @ state))  # [nv, L, dv]
    u = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    o = G.exp()[:, :, None] * (q @ state) + ((q @ k.transpose(1, 2)) * decay) @ u
    last = G[:, -1:]  # [nv, 1]
    state.mul_(last.exp()[:, :, None])
    state.add_((k * (last - G).exp()[:, :, None]).transpose(1, 2) @ u)
    return o


def gated_delta_rule(q, k, v, g, beta, state, keep=()):
    """q, k [T, nk, dk], v [T, nv, dv], g, beta [T, nv] -> o [T, nv, dv] in v's dtype; state
    [nv, dk, dv] fp32 updated in place. keep: (n, out [nv, dk, dv]) pairs, 0 < n <= T, sorted:
    out gets the state after the first n tokens. The T tokens run as segments that end at each
    n (the same math as a forward per segment): a 1-token segment in the recurrent form, a longer
    one in chunks of CHUNK from its start; by fla's kernels where fla_for(v) names them."""
    T, nk = q.shape[:2]
    nv = v.shape[1]
    dtype = v.dtype
    kernels = fla_for(v)
    if kernels is not None:
        segment = functools.partial(_fla_segment, *kernels)
        q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
        g = g.float().contiguous()
    else:
        segment = _segment
        q, k = (_l2norm(x.float()).repeat_interleave(nv // nk, dim=1) for x in (q, k))
        q = q * q.shape[-1] ** -0.5
        v, g, beta = v.float(), g.float(), beta.float()
    out, begin = [], 0
    for end, kept in [*keep, (T, None)]:
        if end > begin:
            out.append(segment(q[begin:end], k[begin:end], v[begin:end], g[begin:end],
                               beta[begin:end], state))
        if kept is not None:
            kept.copy_(state)
        begin = end
    return (out[0] if len(out) == 1 else torch.cat(out)).to(dtype)  # [T, nv, dv]


@functools.cache
def fla_kernels():
    """fla's (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule), or None where fla-core
    is not installed."""
    try:
        from fla.ops.gated_delta_rule import (chunk_gated_delta_rule,
                                              fused_recurrent_gated_delta_rule)
    except ImportError:
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def fla_for(v: torch.Tensor):
    """fla's kernels for inputs like v (cuda, bf16 or fp16), or None: torch's ops."""
    if not v.is_cuda or v.dtype not in (torch.bfloat16, torch.float16):
        return None
    return fla_kernels()


def warm_fla(model_config, device: torch.device, dtype: torch.dtype) -> None:
    """Where fla's kernels will run the model's gated delta rule, one call of each (a chunked
    64-token segment, a recurrent token) on zeros at its head shape: fla autotunes its chunked
    kernels at a head shape's first call (about 40 s on the H200 host's first run, then cached
    on disk), and this makes that part of the load rather than of the first request."""
    c = model_config
    if not c.linear_layers or fla_for(torch.empty(0, device=device, dtype=dtype)) is None:
        return
    state = torch.zeros(c.linear_num_value_heads, c.linear_key_head_dim,
                        c.linear_value_head_dim, device=device)
    for T in (CHUNK, 1):
        qk = torch.zeros(T, c.linear_num_key_heads, c.linear_key_head_dim, device=device,
                         dtype=dtype)
        v = torch.zeros(T, c.linear_num_value_heads, c.linear_value_head_dim, device=device,
                        dtype=dtype)
        g = torch.zeros(T, c.linear_num_value_heads, device=device)
        gated_delta_rule(qk, qk, v, g, g.to(dtype), state)


def kernel_note(model_config, device: torch.device, dtype: torch.dtype):
    """The line run, chat and serve print where a model's Gated DeltaNet layers run on the torch
    ops though fla's kernels could run them (cuda, bf16/fp16, fla-core not installed); else
    None."""
    if (not model_config.linear_layers or device.type != "cuda"
            or dtype not in (torch.bfloat16, torch.float16) or fla_kernels() is not None):
        return None
    return ("the Gated DeltaNet layers run on torch ops: `pip install \"freetoken[cuda]\"` "
            "(fla-core) for fla's Triton kernels, 8-80x faster at prefill")


def _fla_segment(chunk, recurrent, q, k, v, g, beta, state):
    """gated_delta_rule's T tokens of one segment by fla: q, k [T, nk, dk] and v [T, nv, dv] as
    given (fla normalises q and k and serves value head h from key head h // (nv / nk), as ours),
    g [T, nv] fp32, beta [T, nv] -> o [T, nv, dv]; the state [nv, dk, dv] fp32 is fla's initial
    state and gets its final one (fla returns a new tensor). g and beta by keyword: the
    recurrent kernel's 5th and 6th positional arguments are gk and gv."""
    kernel = recurrent if q.shape[0] == 1 else chunk
    o, final = kernel(q[None], k[None], v[None], g=g[None], beta=beta[None],
                      initial_state=state[None], output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
    state.copy_(final[0])
    return o[0]


def _segment(q, k, v, g, beta, state):
    """gated_delta_rule's T tokens of one segment, q, k [T, nv, dk] normalised, all fp32 ->
    o [T, nv, dv] fp32: one token in the recurrent form; more in chunks of CHUNK."""
    T = q.shape[0]
    if T == 1:
        return _recurrent(q[0], k[0], v[0], g[0], beta[0], state)[None]
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # [nv, T, d]
    g, beta = g.t(), beta.t()  # [nv, T]
    out = [_chunk(q[:, s:s + CHUNK], k[:, s:s + CHUNK], v[:, s:s + CHUNK], g[:, s:s + CHUNK],
                  beta[:, s:s + CHUNK], state) for s in range(0, T, CHUNK)]
    return torch.cat(out, dim=1).transpose(0, 1)  # [T, nv, dv]


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer. A family subclass defines its in projections and
    project(x [T, D]) -> (qkv [T, C] in q | k | v order, z [T, nv, dv], b [T, nv], a [T, nv])."""

    def __init__(self, config):
        super().__init__()
        c = config
        self.nk, self.nv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        conv_dim = 2 * self.key_dim + self.value_dim
        self.ssm_conv1d = _named("weight", conv_dim, 1, c.linear_conv_kernel_dim)
        self.ssm_dt = _named("bias", self.nv)
        self.ssm_a_log = nn.Parameter(torch.empty(self.nv))
        self.ssm_norm = GatedRMSNorm(self.dv, c.rms_norm_eps)
        self.ssm_out = Linear(self.value_dim, c.hidden_size, bias=False)

    def project(self, x: torch.Tensor):
        raise NotImplementedError

    def forward(self, x: torch.Tensor, layer: int, step) -> torch.Tensor:
        """x [T, D] -> [T, D]; advances this layer's state in step.state by the T tokens, and
        writes its row of each of step.snapshots (the state after their num_tokens) on the way."""
        T = x.shape[0]
        cache = step.state
        window, state = cache.layer(layer)  # [C, K-1], [nv, dk, dv] fp32
        j, snaps = cache.index[layer], step.snapshots
        ends = [s.num_tokens - cache.num_tokens for s in snaps]  # of the T tokens (not committed)
        qkv, z, b, a = self.project(x)
        qkv = causal_conv(qkv, window, self.ssm_conv1d.weight,
                          [(n, s.conv[j]) for n, s in zip(ends, snaps)])  # [T, C]
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = b.sigmoid()  # [T, nv]
        g = -self.ssm_a_log.float().exp() * F.softplus(a.float() + self.ssm_dt.bias)  # [T, nv]
        out = gated_delta_rule(q.view(T, self.nk, self.dk), k.view(T, self.nk, self.dk),
                               v.view(T, self.nv, self.dv), g, beta, state,
                               [(n, s.recurrent[j]) for n, s in zip(ends, snaps)])  # [T, nv, dv]
        out = self.ssm_norm(out.reshape(T * self.nv, self.dv), z.reshape(T * self.nv, self.dv))
        return self.ssm_out(out.view(T, self.value_dim))
