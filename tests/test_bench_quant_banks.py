"""tools/bench_quant_banks.py: the benches' quantized banks are what convert --quant writes for
the same bf16 experts (the exactly quantized slots, byte for byte, through the real writer and
reader), and the noisy copies beyond them dequantize to finite values within the type's bound."""
import numpy as np
import pytest

import bench_quant_banks as qb
from bench_host_banks import HostBanks
from freetoken.config import ModelConfig
from ftw import open as ftw_open, quant as Q, writer

QUANTS = qb.QUANTS[1:]


def _mc(experts):
    return ModelConfig(family="qwen3_moe", vocab_size=64, hidden_size=128, num_layers=2,
                       num_heads=2, num_kv_heads=1, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
                       max_position_embeddings=64, num_experts=experts, num_experts_per_tok=2,
                       moe_intermediate_size=64, moe_layers=(0, 1), qk_norm="per_head",
                       norm_topk_prob=True, source_dtype="bf16")


def _fp32(bank, info, e) -> dict:
    """Expert e of a bf16 bank: {projection: fp32 values}."""
    slot = bank.data[e * info.slot_stride:(e + 1) * info.slot_stride]
    return {p.name: (slot[p.offset:p.offset + p.nbytes].view(np.uint16).astype(np.uint32) << 16)
            .view(np.float32).reshape(p.shape) for p in info.projections}


@pytest.mark.parametrize("quant", QUANTS)
def test_exact_slots_are_what_the_writer_writes(quant, tmp_path):
    """8 experts x 2 layers (every slot a template slot): the quantized HostBanks equal the
    banks of an FTW file written from the bf16 HostBanks' weights with the same quant type."""
    mc = _mc(8)
    bf16, hb = HostBanks(mc, 1, seed=3), HostBanks(mc, 1, seed=3, quant=quant)
    assert hb.exact_slots == 16 and hb.layout.quant == quant
    entries = [writer.bank_from_arrays(layer, "bf16", [_fp32(b, b.info, e) for e in range(8)], quant)
               for layer, b in bf16.banks.items()]
    path = tmp_path / "m.ftw"
    writer.write(str(path), {"model.config": {"family": "t"}}, [], entries)
    with ftw_open(path) as f:
        loaded = f.load_banks()
        for layer, b in hb.banks.items():
            want = loaded[layer]
            assert (b.info.slot_stride, b.info.quant) == (want.info.slot_stride, want.info.quant)
            assert b.info.projections == want.info.projections
            assert np.array_equal(b.data, want.data), f"layer {layer}"


@pytest.mark.parametrize("quant", QUANTS)
def test_noisy_slots_stay_within_the_type(quant):
    """Slots past the template: element bytes and scales differ from their template slot's
    (a scale in its lowest bit only), nvfp4's tensor scale does not, and every value is finite
    and at most twice the largest bf16 weight's magnitude."""
    mc = _mc(24)  # 48 slots: 16 exact, 32 noisy copies
    bf16, hb = HostBanks(mc, 2, seed=1), HostBanks(mc, 2, seed=1, quant=quant)
    info, stride = hb.banks[0].info, hb.slot_bytes
    slots = hb.data.reshape(-1, stride)
    b0 = bf16.banks[0]
    bound = 2 * max(np.abs(a).max() for e in range(24) for a in _fp32(b0, b0.info, e).values())
    regions, scales = qb.element_regions(info), qb.scale_regions(info)
    moved = []  # slots whose scales moved (fp8_e4m3 here: 3 tile scales a slot, 1 bit each)
    for s in (16, 17, 31, 47):
        t = slots[s % 16]
        assert any(not np.array_equal(slots[s, a:b], t[a:b]) for a, b in regions), s
        moved += [any(not np.array_equal(slots[s, a:b], t[a:b]) for a, b in scales)]
        for a, b in scales:
            assert not ((slots[s, a:b] ^ t[a:b]) & 0xFE).any()  # bit 0 of a byte at most
        for p in info.projections:
            r = Q.regions(quant, p.shape)
            g = p.offset + (r.tensor_scale_offset or r.nbytes)
            assert np.array_equal(slots[s, g:p.offset + p.nbytes], t[g:p.offset + p.nbytes])
            v = Q.dequantize(slots[s, p.offset:p.offset + p.nbytes], quant, p.shape)
            assert np.isfinite(v).all() and np.abs(v).max() <= bound, (s, p.name)
        if quant == "q8_0":
            assert slots[s, regions[0][0]:regions[0][1]].view(np.int8).min() >= -127
    assert any(moved) and (quant == "fp8_e4m3" or all(moved))


def test_bench_decode_sizes_the_cache_in_gb_per_type(capsys):
    """bench_decode --quant bf16,q4_0 --expert-cache-gb: one budget buys each type the slots of
    its own slot size (q4_0 3x bf16's here), both types' tables run, and the last table puts
    each row's tok/s side by side with q4_0's ratio to bf16."""
    import bench_decode
    budget = 8 * 12288 / 1e9  # 8 bf16 slots (64 x 32 experts: 12288 bytes; q4_0: 4096)
    bench_decode.main(["--device", "cpu", "--layers", "2", "--experts", "16", "--hidden", "64",
                       "--inter", "32", "--top-k", "4", "--vocab", "97", "--heads", "2",
                       "--kv-heads", "1", "--head-dim", "32", "--quant", "bf16,q4_0",
                       "--expert-cache-gb", f"{budget!r}", "--cache-fracs", "", "--workloads",
                       "uniform", "--policies", "hybrid", "--history", "4", "--warmup", "1",
                       "--tokens", "2"])
    text = capsys.readouterr().out
    assert "FAILED" not in text
    assert f"--expert-cache-gb {budget:g}: 8 of 32 bf16 slots" in text
    assert f"--expert-cache-gb {budget:g}: 24 of 32 q4_0 slots" in text
    assert "qwen3_moe-shaped bf16 experts as q4_0" in text
    rows = {tuple(c.strip() for c in line.split("|")[1:4]): line.split("|")[4:-1]
            for line in text.splitlines() if line.startswith(f"| {budget:g} GB |")}
    assert set(rows) == {(f"{budget:g} GB", "uniform", r) for r in ("cpu", "hybrid", "limit")}
    for cells in rows.values():
        bf16, q4, ratio = (float(c) for c in cells)
        assert ratio == pytest.approx(q4 / bf16, abs=0.01)


@pytest.mark.parametrize("name,quant", [("qwen3-30b-a3b", "q4_0"), ("gpt-oss-20b", "nvfp4")])
def test_synthetic_file_in_a_quant_type(name, quant):
    """SyntheticFile(quant=): each slot is its bf16 twin's slot quantized (gpt-oss: biases kept
    bf16), and the Engine runs it on cpu with logits near the bf16 model's."""
    import torch
    from bench_shapes import SyntheticFile
    from freetoken.config import EngineConfig
    from freetoken.engine import Engine
    bf16 = SyntheticFile(name, layers=2, experts=4, tiny=True)
    f = SyntheticFile(name, layers=2, experts=4, tiny=True, quant=quant)
    want, got = bf16.load_banks(), f.load_banks()
    assert f.exact[0] == 8 and "bf16 experts as " + quant in f.describe()
    for layer, b in got.items():
        src, dst = want[layer].info, b.info
        assert dst.quant == quant and dst.nbytes == b.data.nbytes < want[layer].data.nbytes
        out = np.empty(dst.slot_stride, np.uint8)
        for e in range(dst.num_experts):
            words = want[layer].data[e * src.slot_stride:(e + 1) * src.slot_stride].view(np.uint16)
            qb.quantize_slot(words, src, dst, out)
            assert np.array_equal(b.data[e * dst.slot_stride:(e + 1) * dst.slot_stride], out)
    logits = {}
    for file in (bf16, f):
        with Engine(file, EngineConfig(device="cpu", ctx_size=64)) as engine:
            logits[file.quant] = engine.score(list(range(3, 20)))
    assert torch.isfinite(logits[quant]).all()
    err = (logits[quant] - logits["bf16"]).abs().max() / logits["bf16"].abs().max()
    assert 0 < err < 0.15, err  # (measured: q4_0 0.020, nvfp4 0.057 of the largest logit)


CUDA_TINY = ["--device", "cuda", "--layers", "2", "--experts", "16", "--hidden", "256", "--inter",
             "128", "--top-k", "4", "--vocab", "1024", "--heads", "4", "--kv-heads", "2",
             "--head-dim", "64", "--no-calibrate"]


def _store_bf16_profile(D, I, P, C):
    """A bf16 profile of this GPU and CPU for D x I experts (in the test's XDG cache)."""
    from freetoken import bandwidth as bw, profile
    shape = profile.ExpertShape(D, I)
    profile.save_profile({"gpu": profile.gpu_name(), "cpu": profile.cpu_model(), "threads": 1,
                          "shape_key": shape.key(), "P": P, "C": C, "B_H": C,
                          "slot_bytes": bw.synthetic_layout(shape).slot_stride,
                          "created": "2026-01-01T00:00:00"})


@pytest.mark.gpu
def test_bench_decode_quant_cuda(capsys, tmp_path, monkeypatch):
    """On cuda every row of each device type runs (Triton reads the quantized slots: the plain
    row too); with --no-calibrate and only a bf16 profile stored, each quantized type's limit
    model and hybrid split take it by profile.FALLBACK_RULE and say so."""
    import bench_decode
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _store_bf16_profile(256, 128, 20.0, 40.0)
    types = ["q8_0", "q4_0", "mxfp4", "fp8_e4m3"]
    bench_decode.main(CUDA_TINY + ["--quant", ",".join(["bf16"] + types), "--expert-cache-gb",
                                   "0.001572864", "--cache-fracs", "0.25", "--workloads",
                                   "uniform", "--policies", "hybrid,offload,static", "--history",
                                   "8", "--warmup", "1", "--tokens", "2"])
    text = capsys.readouterr().out
    assert "FAILED" not in text and "skipped" not in text
    assert text.count(" plain ") >= 5
    for q in types:  # the limit model's line and the hybrid row's split line
        assert text.count(f"no {q} profile: 256x128-bf16's with C x") >= 2, q
    assert "| 0.00157286 GB | uniform | hybrid |" in text


@pytest.mark.gpu
def test_bench_decode_calibrates_each_type_cuda(capsys, tmp_path, monkeypatch):
    """Without --no-calibrate each type calibrates its own profile (stored under its key), and
    its hybrid rows run on it: no fallback."""
    import bench_decode
    from freetoken import profile
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    bench_decode.main(CUDA_TINY[:-1] + ["--quant", "bf16,q4_0", "--cache-fracs", "0.25",
                                        "--workloads", "uniform", "--policies", "hybrid",
                                        "--history", "8", "--warmup", "1", "--tokens", "2"])
    text = capsys.readouterr().out
    assert "FAILED" not in text and "no q4_0 profile" not in text and "calibration" in text
    for key in ("256x128-bf16", "256x128-bf16-q4_0"):
        assert f"{key}, measured concurrently" in text, key
        assert profile.find_profile(profile.gpu_name(), lambda p: p["shape_key"] == key)
    assert text.count("split: hybrid: q* = round(m P/(P+C))") == 2


@pytest.mark.gpu
def test_bench_prefill_quant_cuda(capsys):
    import bench_prefill
    bench_prefill.main(CUDA_TINY[:-1] + ["--quant", "bf16,q4_0,mxfp4", "--lengths", "512,1024",
                                         "--crossover", ""])
    text = capsys.readouterr().out
    assert "FAILED" not in text
    assert [line.split("|")[1].strip() for line in text.splitlines()
            if line.startswith("| ") and "| 2 |" in line] == ["bf16", "q4_0", "mxfp4"]  # 1024 tokens
