"""ExpertRuntime equals DenseReferenceExperts for every cache size x policy x phase, on random
host banks laid out per docs/INTERFACES.md section 3 (built here; no ftw reader needed)."""
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from freetoken.config import ModelConfig
from freetoken.experts.bank import TORCH_DTYPES
from freetoken.experts.reference import DenseReferenceExperts

PAGE = 4096


def _round_up(n, a):
    return (n + a - 1) // a * a


def make_banks(layers, num_experts, hidden, inter, dtype="fp32", seed=0):
    """{layer: HostBank-like} with random experts; returns (banks, dense) where
    dense[layer][e] = (gate [I, D], up [I, D], down [D, I]) as fp32 torch tensors."""
    tdtype = TORCH_DTYPES[dtype]
    esize = torch.empty((), dtype=tdtype).element_size()
    shapes = [("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))]
    projections, off = [], 0
    for name, shape in shapes:
        nbytes = shape[0] * shape[1] * esize
        projections.append(SimpleNamespace(name=name, shape=shape, offset=off, nbytes=nbytes))
        off = _round_up(off + nbytes, 64)
    stride = _round_up(off, PAGE)
    gen = torch.Generator().manual_seed(seed)
    banks, dense = {}, {}
    for layer in layers:
        data = np.zeros(num_experts * stride, dtype=np.uint8)
        dense[layer] = []
        for e in range(num_experts):
            ws = []
            for p in projections:
                w = (torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5).to(tdtype)
                start = e * stride + p.offset
                data[start:start + p.nbytes] = w.reshape(-1).view(torch.uint8).numpy()
                ws.append(w.float())
            dense[layer].append(tuple(ws))
        crcs = tuple(zlib.crc32(data[e * stride:(e + 1) * stride]) for e in range(num_experts))
        info = SimpleNamespace(layer=layer, name=f"blk.{layer}.ffn_exps", offset=0,
                               num_experts=num_experts, slot_stride=stride, dtype=dtype,
                               projections=tuple(projections), slot_crc32=crcs)
        banks[layer] = SimpleNamespace(info=info, data=data)
    return banks, dense


def make_config(layers, num_experts, hidden, inter, top_k):
    return ModelConfig(family="qwen3_moe", vocab_size=32, hidden_size=hidden,
                       num_layers=max(layers) + 1, num_heads=2, num_kv_heads=1, head_dim=hidden // 2,
                       rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=128,
                       num_experts=num_experts, num_experts_per_tok=top_k,
                       moe_intermediate_size=inter, moe_layers=tuple(layers))


def random_routes(gen, T, E, K):
    """expert_ids [T, K] (distinct per token) and weights [T, K] fp32."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=gen)
    return ids, w / w.sum(-1, keepdim=True)


def naive_moe(dense, layer, x, ids, w):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            g, u, d = (m.double() for m in dense[layer][int(ids[t, k])])
            xt = x[t].double()
            out[t] += w[t, k].double() * (d @ (torch.nn.functional.silu(g @ xt) * (u @ xt)))
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_reference_equals_naive_loop(dtype):
    layers, E, D, I, K = [1, 3], 8, 16, 12, 3
    banks, dense = make_banks(layers, E, D, I, dtype, seed=1)
    ref = DenseReferenceExperts(banks, make_config(layers, E, D, I, K), "cpu", torch.float32)
    gen = torch.Generator().manual_seed(2)
    for layer in layers:
        x = torch.randn(5, D, generator=gen)
        ids, w = random_routes(gen, 5, E, K)
        got = ref.forward(layer, x, ids, w)
        assert got.dtype == torch.float32 and got.shape == (5, D)
        torch.testing.assert_close(got.double(), naive_moe(dense, layer, x, ids, w),
                                   atol=1e-5, rtol=1e-5)
    assert ref.stats["routes"] == 2 * 5 * K
