"""Shared blocks of the decoder: RMSNorm, rotary embeddings (+ the rope scalings of the supported
families), GQA attention over the KV cache (+ q/k norm variants, clip_qkv), dense SwiGLU MLP.
Module attribute names are the canonical FTW suffixes (attn_q, ffn_up, ...): see loader.py.
On cuda with Triton the norms, q/k/v and the q/k norm + rotary run as fused kernels (fused.py,
FREETOKEN_FUSED=0 turns them off); the torch code here is the reference and the cpu path.

Shape legend: T tokens of this forward, S cached + new tokens, D hidden, H heads, KV kv heads,
hd head dim, I dense MLP width.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import ModelError
from . import fused


class Linear(nn.Linear):
    """nn.Linear without the random init: every weight is loaded (loader.py). On the meta
    device the init ops would import torch._dynamo (~1.5 s of a model's load time)."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """nn.Embedding without the random init (see Linear)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    """x / rms(x) * weight; the statistics in fp32, the weight multiply in x's dtype (as HF)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused(x):
            return fused.rms_norm(x, self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)  # one op, not five
        return self.weight * normed.to(x.dtype)

    def add_forward(self, h: torch.Tensor, delta):
        """(h + delta, self(h + delta)), one kernel on cuda; delta None: (h, self(h))."""
        if delta is None:
            return h, self(h)
        if self._fused(h) and delta.dtype == h.dtype:
            return fused.add_rms_norm(h, delta, self.weight, self.eps)
        h = h + delta
        return h, self(h)

    def _fused(self, x: torch.Tensor) -> bool:
        return fused.enabled(x) and self.weight.dtype == x.dtype


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # [hd/2]


def rope_inv_freq(config, seq_len: int):
    """(inv_freq [hd/2] fp32, attention_scaling) for the config's rope scaling at a sequence of
    seq_len tokens (only `dynamic` depends on seq_len). Formulas: linear (position interpolation),
    dynamic NTK, YaRN, llama3 frequency smoothing."""
    base, dim = config.rope_theta, config.head_dim
    rs = config.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return _default_inv_freq(base, dim), 1.0
    if kind == "linear":
        return _default_inv_freq(base, dim) / rs["factor"], 1.0
    if kind == "dynamic":
        # NTK-aware base growth once the sequence exceeds the trained length
        max_pos, factor = config.max_position_embeddings, rs["factor"]
        seq_len = max(seq_len, max_pos)
        base = base * (factor * seq_len / max_pos - (factor - 1)) ** (dim / (dim - 2))
        return _default_inv_freq(base, dim), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(config, rs)
    if kind == "llama3":
        return _llama3_inv_freq(config, rs), 1.0
    raise ModelError(f"rope scaling {kind!r} is not supported; supported: default, linear, "
                     "dynamic, yarn, llama3")


def _yarn_inv_freq(config, rs):
    base, dim = config.rope_theta, config.head_dim
    orig_max = rs.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = rs.get("factor") or config.max_position_embeddings / orig_max

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = rs.get("attention_factor")
    if attn_factor is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attn_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(num_rotations):  # the dim whose wavelength makes num_rotations in orig_max
        return dim * math.log(orig_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by factor
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attn_factor)


def _llama3_inv_freq(config, rs):
    inv_freq = _default_inv_freq(config.rope_theta, config.head_dim)
    factor, low_ff, high_ff = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs.get("original_max_position_embeddings") or config.max_position_embeddings
    low_wavelen, high_wavelen = old_len / low_ff, old_len / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Rotary:
    """cos/sin tables for given positions. Plain object (no buffers), so that meta-device model
    construction leaves nothing to re-initialise; inv_freq is made on first use per device."""

    def __init__(self, config):
        self.config = config
        rs = config.rope_scaling or {}
        self.is_dynamic = rs.get("rope_type", rs.get("type")) == "dynamic"
        self._cached = {}  # device -> (inv_freq [hd/2], attention_scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [T] int64 -> (cos, signed sin), each [T, 1, hd] in dtype, for apply_rotary:
        the sin's first half is negated, so that rotate_half(x) * sin = roll(x) * signed sin."""
        device = positions.device
        seq_len = self.config.max_position_embeddings
        if self.is_dynamic:  # NTK base grows with the longest position (one host sync)
            seq_len = max(seq_len, int(positions.max()) + 1)
        if seq_len > self.config.max_position_embeddings:
            inv_freq, scale = rope_inv_freq(self.config, seq_len)
            inv_freq = inv_freq.to(device)
        else:
            if device not in self._cached:
                inv_freq, scale = rope_inv_freq(self.config, seq_len)
                self._cached[device] = (inv_freq.to(device), scale)
            inv_freq, scale = self._cached[device]
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, hd]
        cos, sin = (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # negation is exact
        return cos[:, None, :], sin[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The NeoX half-split rotation used by these families: x * cos + rotate_half(x) * sin,
    rotate_half(x) = cat(-x2, x1). x [T, heads, hd]; cos and signed sin [T, 1, hd] from
    Rotary.cos_sin, so rotate_half(x) * sin is roll(x, hd/2) * signed sin: the same products
    (bit for bit), two ops fewer per call."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class Attention(nn.Module):
    """GQA attention. qk_norm: `per_head` = RMSNorm over hd after the head split (qwen3_moe),
    `full` = RMSNorm over the whole projection before the split (olmoe); clip_qkv clamps q/k/v
    after the norms (olmoe)."""

    def __init__(self, config, output_bias: bool = False):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.qk_norm, self.clip_qkv = c.qk_norm, c.clip_qkv
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.attn_q = Linear(c.hidden_size, q_dim, bias=c.attention_bias)
        self.attn_k = Linear(c.hidden_size, kv_dim, bias=c.attention_bias)
        self.attn_v = Linear(c.hidden_size, kv_dim, bias=c.attention_bias)
        self.attn_output = Linear(q_dim, c.hidden_size, bias=output_bias)
        if c.qk_norm == "per_head":
            self.attn_q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.attn_k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        elif c.qk_norm == "full":
            self.attn_q_norm = RMSNorm(q_dim, c.rms_norm_eps)
            self.attn_k_norm = RMSNorm(kv_dim, c.rms_norm_eps)
        elif c.qk_norm != "none":
            raise ModelError(f"qk_norm {c.qk_norm!r} is not supported (none, per_head, full)")
        self._qkv = None  # cuda: (weights' data_ptrs, fused weight, fused bias), see _fused_qkv

    def forward(self, x: torch.Tensor, layer: int, step) -> torch.Tensor:
        """x [T, D] -> [T, D]; writes this layer's k/v for the T tokens into step.kv_cache.
        On cuda (fused.enabled) q/k/v are one matmul and the q/k norm + rotary one kernel."""
        T = x.shape[0]
        is_fused = fused.enabled(x)
        if is_fused:
            q, k, v = self._fused_qkv(x)  # views of one [T, (H + 2 KV) hd] output
        else:
            q, k, v = self.attn_q(x), self.attn_k(x), self.attn_v(x)  # [T, H*hd], [T, KV*hd] x2
        if self.qk_norm == "full":
            q, k = self.attn_q_norm(q), self.attn_k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        v = v.view(T, self.num_kv_heads, self.head_dim)  # [T, KV, hd]
        if is_fused and self._fusable_qk(q, step):
            q, k = self._fused_qk_rotary(q, k, step)  # [T, H, hd], [T, KV, hd]
        else:
            q = q.view(T, self.num_heads, self.head_dim)  # [T, H, hd]
            k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, KV, hd]
            if self.qk_norm == "per_head":
                q, k = self.attn_q_norm(q), self.attn_k_norm(k)
            q, k = apply_rotary(q, step.cos, step.sin), apply_rotary(k, step.cos, step.sin)
        keys, values = step.kv_cache.store(layer, step.start, k, v)  # [KV, S, hd] x2
        if T == 1 and isinstance(step.mask, torch.Tensor):  # captured decode: fixed span, masked
            return self.attn_output(_grouped_decode_attention(q, keys, values, step.mask))
        is_causal = isinstance(step.mask, str)
        with sdpa_kernel(SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys[None], values[None],
                attn_mask=None if is_causal else step.mask, is_causal=is_causal,
                scale=self.head_dim ** -0.5, enable_gqa=self.num_heads != self.num_kv_heads)  # [1, H, T, hd]
        return self.attn_output(out[0].transpose(0, 1).reshape(T, -1))

    def _fused_qkv(self, x: torch.Tensor):
        """q [T, H*hd], k, v [T, KV*hd] as views of one matmul over the concatenated weights,
        concatenated on the first call (never while a CUDA graph is captured: the engine runs
        every captured step once inline first) and again if the weights were replaced."""
        lin = (self.attn_q, self.attn_k, self.attn_v)
        if self._qkv is None or self._qkv[0] != tuple(m.weight.data_ptr() for m in lin):
            capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
            if capturing or not fused.can_fuse_qkv(*lin):
                return tuple(m(x) for m in lin)
            weight, bias = fused.fuse_qkv(*lin)
            self._qkv = (tuple(m.weight.data_ptr() for m in lin), weight, bias)
        _, weight, bias = self._qkv
        sizes = [m.weight.shape[0] for m in lin]
        return F.linear(x, weight, bias).split(sizes, dim=-1)

    def _fusable_qk(self, q: torch.Tensor, step) -> bool:
        """Whether fused.qk_rope computes what the torch code does: all in q's dtype."""
        ts = [step.cos, step.sin]
        if self.qk_norm == "per_head":
            ts += [self.attn_q_norm.weight, self.attn_k_norm.weight]
        return all(t.dtype == q.dtype for t in ts)

    def _fused_qk_rotary(self, q: torch.Tensor, k: torch.Tensor, step):
        norms = ()
        if self.qk_norm == "per_head":
            qn, kn = self.attn_q_norm, self.attn_k_norm
            norms = ((qn.weight, qn.eps), (kn.weight, kn.eps))
        return fused.qk_rope(q, k, step.cos, step.sin, self.head_dim, *norms)


def _grouped_decode_attention(q, keys, values, mask):
    """One query token over a fixed span of S cache slots (graphs.StaticKV): q [1, H, hd], keys
    and values [KV, S, hd], mask [1, S] bool -> [1, H*hd]. The G = H/KV query heads that share
    a kv head are that head's G queries (head h reads kv head h // G), so no key is repeated
    and the masked kernel needs no GQA support."""
    _, H, hd = q.shape
    KV = keys.shape[0]
    with sdpa_kernel(SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(
            q.view(KV, H // KV, hd)[None], keys[None], values[None], attn_mask=mask,
            scale=hd ** -0.5)  # [1, KV, G, hd]
    return out.reshape(1, H * hd)


# Not cuDNN: on the H200 its SDPA spent ~5 ms of host time per call (a new plan for every new KV
# length, i.e. every decode step), 69% of a decode step's CPU time (tools/profile_decode.py).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_mask(start: int, num_new: int, sliding_window, device):
    """Bool mask [T, S] (True = attend) for tokens at cache slots [start, start + T) over slots
    [0, start + T): causal, and within `sliding_window` tokens (self included) when set.
    None when every query may see every key (a single token), "causal" when the mask is the
    plain square causal one (a first chunk that the window does not cut)."""
    end = start + num_new
    if num_new == 1 and (sliding_window is None or end <= sliding_window):
        return None
    if start == 0 and (sliding_window is None or end <= sliding_window):
        return "causal"  # the square causal case: SDPA's is_causal, which can use flash kernels
    q_slot = torch.arange(start, end, device=device)[:, None]  # [T, 1]
    k_slot = torch.arange(end, device=device)[None, :]  # [1, S]
    mask = k_slot <= q_slot
    if sliding_window is not None:
        mask &= k_slot > q_slot - sliding_window
    return mask


class DenseMLP(nn.Module):
    """SwiGLU MLP of the non-MoE layers: ffn_down(silu(ffn_gate x) * ffn_up x)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.ffn_gate = Linear(hidden, inter, bias=False)
        self.ffn_up = Linear(hidden, inter, bias=False)
        self.ffn_down = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor, layer: int, step) -> torch.Tensor:
        return self.ffn_down(F.silu(self.ffn_gate(x)) * self.ffn_up(x))
