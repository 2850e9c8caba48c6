"""Paged KV (kv_cache.py) under the model's forward: a sequence whose pages lie shuffled in the
pool gives the logits of the same sequence in one contiguous cache, for chunked prefill, eager
decode and the captured step's forward (StaticKV, read through its page table); and the
engine's KV pool options."""
from types import SimpleNamespace

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.errors import ConfigError
from freetoken.graphs import StaticKV
from freetoken.kv_cache import KVCache, KVPages, SequenceKV
from fused_support import FAMILIES, make_model

IDS = torch.tensor([5, 17, 3, 41, 22, 8, 30, 11, 2, 47, 19, 6, 33, 14])  # 14 tokens


def paged(model, page_table, page_size=4, num_pages=8):
    pages = KVPages(model.config, num_pages, page_size, "cpu", torch.float32)
    pages.data.normal_()  # stale K/V in every slot: nothing may read what was not written
    table = SimpleNamespace(page_table=list(page_table), num_kv_tokens=0)
    return SequenceKV(pages, table, len(page_table) * page_size)


def run(model, kv, chunk=5, decode_from=11, static=False):
    """Logits of IDS: prefill of IDS[:decode_from] in chunks, then one token at a time (eager,
    or the captured step's forward through StaticKV over a span of 16)."""
    rows = []
    with torch.inference_mode():
        for s in range(0, decode_from, chunk):
            e = min(s + chunk, decode_from)
            rows.append(model(IDS[s:e], torch.arange(s, e), kv))
        for i in range(decode_from, len(IDS)):
            if not static:
                rows.append(model(IDS[i:i + 1], torch.tensor([i]), kv))
                continue
            pos = torch.tensor([i])
            kv.reserve(1)
            rows.append(model(IDS[i:i + 1], pos, StaticKV(kv, pos, 16), 1))
            kv.commit(1)
    return torch.cat(rows)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_shuffled_pages_equal_a_contiguous_cache(family, static):
    model = make_model(family, "cpu", torch.float32)
    ref = run(model, KVCache(model.config, 16, "cpu", torch.float32), static=static)
    ours = run(model, paged(model, [5, 0, 7, 2]), static=static)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_consecutive_pages_are_views_and_others_gathered():
    model = make_model("qwen3_moe", "cpu", torch.float32)
    kv = paged(model, [2, 3, 4])
    kv.reserve(9)
    k = torch.randn(9, model.config.num_kv_heads, model.config.head_dim)
    keys, _ = kv.store(0, 0, k, k)
    assert keys._base is not None and keys.data_ptr() == kv.data[0, 0, :, 8].data_ptr()
    kv = paged(model, [2, 0, 4])
    kv.reserve(9)
    keys, _ = kv.store(0, 0, k, k)
    torch.testing.assert_close(keys, k.transpose(0, 1))
    assert torch.equal(kv.data[0, 0, :, 1], k[5])  # position 5: page 0, row 1


def test_context_full_is_refused():
    model = make_model("qwen3_moe", "cpu", torch.float32)
    kv = paged(model, [1, 2])
    kv.reserve(8)
    kv.commit(8)
    with pytest.raises(Exception, match="--ctx-size"):
        kv.reserve(1)


def test_engine_config_kv_budget():
    assert EngineConfig(ctx_size=100, parallel=3).kv_budget == 300
    assert EngineConfig(ctx_size=100, kv_tokens=50).kv_budget == 50
    with pytest.raises(ConfigError, match="--parallel"):
        EngineConfig(parallel=0)
    with pytest.raises(ConfigError, match="--kv-tokens"):
        EngineConfig(kv_tokens=0)
