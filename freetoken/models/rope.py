"""Rotary position embeddings: the cos/sin tables (Rotary) with the rope scalings of the supported
families (linear, dynamic NTK, YaRN, llama3), and the NeoX half-split rotation (apply_rotary), on
all of a head or on its first rd dims (apply_partial_rotary).

Shape legend: T tokens, hd head dim, rd rotated dims of a head (hd * partial_rotary_factor).
"""
import math

import torch

from ..errors import ModelError


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # [hd/2]


def rope_inv_freq(config, seq_len: int):
    """(inv_freq [hd/2] fp32, attention_scaling) for the config's rope scaling at a sequence of
    seq_len tokens (only `dynamic` depends on seq_len). Formulas: linear (position interpolation),
    dynamic NTK, YaRN, llama3 frequency smoothing."""
    base, dim = config.rope_theta, config.rotary_dim
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
    base, dim = config.rope_theta, config.rotary_dim
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
    inv_freq = _default_inv_freq(config.rope_theta, config.rotary_dim)
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
        inv_freq, scale = self.inv_freq_scale(positions)  # [hd/2], float
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, hd]
        cos, sin = (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # negation is exact
        return cos[:, None, :], sin[:, None, :]

    def inv_freq_scale(self, positions: torch.Tensor):
        """(inv_freq [hd/2] fp32 on positions' device, the cos/sin scale) for a forward over
        positions [T] (a family with its own rope scaling overrides it)."""
        device = positions.device
        seq_len = self.config.max_position_embeddings
        if self.is_dynamic:  # NTK base grows with the longest position (one host sync)
            seq_len = max(seq_len, int(positions.max()) + 1)
        if seq_len > self.config.max_position_embeddings:
            inv_freq, scale = rope_inv_freq(self.config, seq_len)
            return inv_freq.to(device), scale
        if device not in self._cached:
            inv_freq, scale = rope_inv_freq(self.config, seq_len)
            self._cached[device] = (inv_freq.to(device), scale)
        return self._cached[device]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The NeoX half-split rotation used by these families: x * cos + rotate_half(x) * sin,
    rotate_half(x) = cat(-x2, x1). x [T, heads, hd]; cos and signed sin [T, 1, hd] from
    Rotary.cos_sin, so rotate_half(x) * sin is roll(x, hd/2) * signed sin: the same products
    (bit for bit), two ops fewer per call."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation on the first rd dims of each head (rd = cos.shape[-1]), the rest unchanged:
    x [T, heads, hd], cos and signed sin [T, 1, rd] (Rotary.cos_sin)."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat((apply_rotary(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)
