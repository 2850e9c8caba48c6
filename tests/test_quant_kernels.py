"""CPU expert kernels on q8_0 / q4_0 / mxfp4 / nvfp4 / fp8_e4m3 banks against numpy dequantize
(ftw/quant.py) then a torch fp32 reference, on every ISA path this CPU has; banks laid out by
ftw's BankEntry (SPEC.md §5.2, §9.2). Both paths KernelTuning.qdot chooses:

  fp32 (cython/qdot_impl.c): 1e-5 of the output's largest magnitude (the kernels' weights are
      the reference's bits, nvfp4's up to g's rounding, qdot.h; what is left is the order of
      fp32 additions).
  int8 (cython/qdot8_impl.c; nvfp4 and fp8_e4m3 have none and run fp32): against the same computation in
      float64 with x and h quantized per 32-block as qdot.h says (`int8_reference`): 1e-5 of
      the largest magnitude for the median token, 3e-3 for the worst (where the kernel's fp32 h
      and the reference's float64 h round to neighbouring codes: one code of one element); and
      against the fp32 oracle: each output row within INT8_ROW_RTOL (4e-2) of its norm (the
      rounding of x and h, at most amax / 254 per element of a block: 1-2% seen on random data).
"""
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from freetoken import kernels
from ftw import quant as Q
from ftw.layout import bank_from_arrays

from test_kernels import ACT_REF, assert_close, reference, routes
from test_kernels import pools  # noqa: F401 (the kernel pools fixture, one per threads x ISA)

ISAS = kernels.available_isas()
QUANTS = kernels.KERNEL_QUANTS
QDOTS = ("fp32", "int8")
INT8_QUANTS = ("q8_0", "q4_0", "mxfp4")  # the types the int8 path runs (qdot.h)
INT8_ROW_RTOL = 4e-2


def set_qdot(pool, qdot, tune=""):
    """The pool with KernelTuning.parse(tune) and qdot; returns it."""
    pool.tuning = replace(kernels.KernelTuning.parse(tune), qdot=qdot)
    return pool


def path_run(isa, quant, qdot):
    """The ISA path a job reports: the int8 kernels' avx512 form needs AVX512-VNNI (else avx2)."""
    if qdot == "int8" and quant in INT8_QUANTS and isa.startswith("avx512") and not kernels.qdot8_has_vnni():
        return "avx2"
    return {"avx512bf16": "avx512"}.get(isa, isa)


def quantize_dequantize(v):
    """v (float32, [..., K]) rounded as the int8 path quantizes its inputs (qdot.h): per
    32-block d = amax / 127, q = rint(v * (127 / amax)), back to q * d in float64."""
    b = np.asarray(v, np.float32).reshape(-1, 32)
    amax = np.abs(b).max(1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    return (np.rint(b * inv).astype(np.float64) * (amax / np.float32(127))).reshape(np.shape(v))


def int8_reference(x, weights3, tok, exp, w, act="silu"):
    """What the int8 path computes, in float64: x and h quantized and dequantized."""
    gate, up, down = (t.double() for t in weights3)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, e, wt in zip(tok.tolist(), exp.tolist(), w.tolist()):
        xq = torch.from_numpy(quantize_dequantize(x[t].numpy()))
        h = ACT_REF[act](gate[e] @ xq).float() * (up[e] @ xq).float()  # h in fp32, as the kernel's
        out[t] += wt * (down[e] @ torch.from_numpy(quantize_dequantize(h.numpy())))
    return out


def assert_int8_close(out, x, w3, tok, exp, w, what, act="silu"):
    """The int8 path's tolerances (module docstring)."""
    emu = int8_reference(x, w3, tok, exp, w, act).numpy()
    scale = np.abs(emu).max() + 1e-6
    err = np.abs(out - emu).max(axis=1) / scale  # per token
    assert np.median(err) <= 1e-5 and err.max() <= 3e-3, f"{what}: vs int8_reference {err}"
    want = reference(x, w3, tok, exp, w, act).double().numpy()
    rows = np.linalg.norm(out - want, axis=1) / (np.linalg.norm(want, axis=1) + 1e-12)
    assert rows.max() <= INT8_ROW_RTOL, f"{what}: rows vs the fp32 oracle {rows}"


def make_qbank(E, D, I, quant, seed=0, every_code=False):
    """A quantized bank of E random experts -> (bank uint8, layout, (gate, up, down) the
    dequantized fp32 weights [E, out, in]). every_code: the elements and scales are random
    codes instead (every e2m1 / int code; e8m0 over 2^-20 .. 2^20; every finite e4m3, subnormal
    ones included; g random), so each table the kernels decode through is read whole."""
    rng = np.random.default_rng(seed)
    experts = [{"gate": rng.standard_normal((I, D), np.float32) / D ** 0.5,
                "up": rng.standard_normal((I, D), np.float32) / D ** 0.5,
                "down": rng.standard_normal((D, I), np.float32) / I ** 0.5} for _ in range(E)]
    entry = bank_from_arrays(0, "fp32", experts, quant=quant)
    bank = np.zeros(E * entry.slot_stride, np.uint8)
    deq = {"gate": [], "up": [], "down": []}
    for e in range(E):
        data = entry.read_expert(e)
        if every_code:
            data = {p["name"]: random_codes(quant, p["shape"], rng) for p in entry.projections}
        for p in entry.projections:
            start = e * entry.slot_stride + p["offset"]
            bank[start:start + p["nbytes"]] = data[p["name"]]
            deq[p["name"]].append(Q.dequantize(data[p["name"]], quant, p["shape"]))
    info = SimpleNamespace(name="blk.0.ffn_exps", slot_stride=entry.slot_stride, dtype="fp32",
                           quant=quant, projections=[SimpleNamespace(**p) for p in entry.projections])
    w3 = tuple(torch.from_numpy(np.stack(deq[k])) for k in ("gate", "up", "down"))
    return bank, kernels.layout_from_bank_info(info), w3


def random_codes(quant, shape, rng):
    r = Q.regions(quant, shape)
    data = np.zeros(r.nbytes, np.uint8)
    data[:r.qs_nbytes] = rng.integers(0, 256, r.qs_nbytes)
    n = r.scales_shape[0] * r.scales_shape[1]
    if quant == "mxfp4":
        scales = rng.integers(127 - 20, 127 + 21, n).astype(np.uint8)
    elif quant == "nvfp4":
        scales = rng.choice(np.r_[0:0x7f, 0x80:0xff], n).astype(np.uint8)  # all but the NaNs
    elif quant == "fp8_e4m3":  # every finite e4m3 element; fp32 tile scales of either sign
        data[:r.qs_nbytes] = rng.choice(np.r_[0:0x7f, 0x80:0xff], r.qs_nbytes)
        scales = (rng.standard_normal(n) * 1e-3).astype("<f4").view(np.uint8)
    else:  # fp16 d, finite, of either sign
        scales = (rng.standard_normal(n) * 0.01).astype("<f2").view(np.uint8)
    data[r.scales_offset:r.scales_offset + scales.size] = scales
    if r.tensor_scale_offset is not None:
        data[r.tensor_scale_offset:] = np.array([rng.uniform(1e-4, 1e-2)], "<f4").view(np.uint8)
    return data


# (D, I, T, K, E): whole 32-blocks but odd block counts, tokens 1..64, top-k 1..8
CASES = [(96, 32, 1, 1, 3), (160, 96, 5, 8, 10), (64, 224, 64, 4, 6), (32, 288, 17, 8, 8)]
# nvfp4's blocks are 16: rows that end in a half 32-block (16, 48, 80, 112 elements)
HALF_CASES = [(80, 48, 3, 2, 4), (48, 112, 64, 4, 5), (16, 80, 9, 8, 8)]


# fp8_e4m3's tiles are 128 x 128 and may be partial: dims that are not multiples of 128 (nor of
# 16 or 32: the vector kernels' scalar tails), batches of 1, 4 and 16 tokens
FP8_CASES = [(200, 136, 1, 1, 3), (130, 300, 4, 4, 5), (257, 75, 16, 8, 8), (384, 256, 16, 2, 4)]


def cases(quant):
    if quant == "fp8_e4m3":
        return CASES + FP8_CASES
    return CASES + (HALF_CASES if quant == "nvfp4" else [])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qdot", QDOTS)
def test_matches_dequantized_reference(pools, isa, quant, threads, qdot):
    pool = set_qdot(pools(threads, isa), qdot)
    rng = np.random.default_rng(7)
    for i, (D, I, T, K, E) in enumerate(cases(quant)):
        bank, layout, w3 = make_qbank(E, D, I, quant, seed=i)
        x = torch.randn(T, D, generator=torch.Generator().manual_seed(i))
        tok, exp, w = routes(T, K, E, rng)
        out = pool.run(x.numpy(), bank, layout, tok, exp, w, np.zeros((T, D), np.float32))
        assert pool.last_isa == path_run(isa, quant, qdot)
        what = f"{isa} {quant} {qdot} threads={threads} D={D} I={I} T={T} K={K}"
        if qdot == "int8" and quant in INT8_QUANTS:
            assert_int8_close(out, x, w3, tok, exp, w, what)
        else:
            assert_close(out, reference(x, w3, tok, exp, w), 1e-5, what)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("qdot", QDOTS)
def test_every_code_and_scale_decodes_as_the_reference(pools, isa, quant, qdot):
    """Random element and scale codes (not what a quantizer writes): e8m0 far from 1, e4m3
    subnormals and negative scales, every nibble, read by each path as ftw.quant reads them."""
    rng = np.random.default_rng(11)
    for i, (D, I, T, K, E) in enumerate(cases(quant)[-3:]):
        bank, layout, w3 = make_qbank(E, D, I, quant, seed=20 + i, every_code=True)
        x = torch.randn(T, D, generator=torch.Generator().manual_seed(i))
        tok, exp, w = routes(T, K, E, rng)
        pool = set_qdot(pools(1, isa), qdot)
        out = pool.run(x.numpy(), bank, layout, tok, exp, w, np.zeros((T, D), np.float32),
                       act="gelu")  # bounded in both directions: no silu overflow
        assert np.isfinite(out).all()
        what = f"{isa} {quant} {qdot} every code D={D} I={I} T={T}"
        if qdot == "int8" and quant in INT8_QUANTS:
            assert_int8_close(out, x, w3, tok, exp, w, what, "gelu")
        else:
            assert_close(out, reference(x, w3, tok, exp, w, "gelu"), 1e-5, what)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("qdot", QDOTS)
def test_modes_threads_and_tunings_agree_bit_for_bit(pools, isa, quant, qdot, monkeypatch):
    """Staged and direct down modes, 1 or 2 threads, other work-item sizes, rows per pass and
    prefetching: the same bits; duplicate routes and every activation accumulate as the reference says."""
    bank, layout, w3 = make_qbank(7, 128, 64, quant, seed=4)
    x = torch.randn(9, 128)
    tok, exp, w = routes(9, 4, 7, np.random.default_rng(5))
    tok, exp, w = np.r_[tok, tok[:3]], np.r_[exp, exp[:3]], np.r_[w, w[:3]]  # duplicates
    for act in kernels.ACTS:
        outs = []
        for cap, threads, tune in ((kernels.STAGE_MAX_BYTES, 1, ""), (0, 2, ""),
                                   (kernels.STAGE_MAX_BYTES, 2, "item_kb=4,rows=4,down_rows=2,prefetch=0"),
                                   (0, 1, "prefetch=512,prefetch_hint=t0,help=0")):
            monkeypatch.setattr(kernels, "STAGE_MAX_BYTES", cap)
            pool = set_qdot(pools(threads, isa), qdot, tune)
            outs.append(pool.run(x.numpy(), bank, layout, tok, exp, w, np.zeros((9, 128), np.float32),
                                 act=act))
            set_qdot(pool, qdot)
        if qdot == "int8" and quant in INT8_QUANTS:
            if act != "clamped_swiglu":  # (int8_reference knows the named activations only)
                assert_int8_close(outs[0], x, w3, tok, exp, w, f"{isa} {quant} int8 {act}", act)
        else:
            assert_close(outs[0], reference(x, w3, tok, exp, w, act), 1e-5, f"{isa} {quant} {act}")
        for out in outs[1:]:
            assert np.array_equal(out, outs[0]), f"{isa} {quant} {act}: modes or tunings differ"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("quant", INT8_QUANTS)
def test_one_input_rows_per_pass_agree_bit_for_bit(pools, isa, quant):
    """Decode's usual call, one input per expert: the int8 kernels take its rows in fours, then
    a pair, then one (cython/qdot8_impl.c); rows and down_rows 1, 2 and 4, whole projections and
    4 KiB items (row counts that are not multiples of four), give the same bits, which batched
    decode's exactness rests on."""
    bank, layout, w3 = make_qbank(5, 224, 96, quant, seed=9)
    x = torch.randn(1, 224, generator=torch.Generator().manual_seed(3))
    tok, exp, w = np.zeros(3, np.int32), np.array([4, 0, 2], np.int32), np.full(3, 1 / 3, np.float32)
    outs = []
    for tune in ("rows=1,down_rows=1", "rows=2,down_rows=2", "rows=4,down_rows=4",
                 "rows=4,down_rows=1,item_kb=4", "rows=1,down_rows=4,item_kb=4"):
        pool = set_qdot(pools(1, isa), "int8", tune)
        outs.append(pool.run(x.numpy(), bank, layout, tok, exp, w, np.zeros((1, 224), np.float32)))
        set_qdot(pool, "int8")
    assert_int8_close(outs[0], x, w3, tok, exp, w, f"{isa} {quant} one input")
    for out, tune in zip(outs[1:], ("rows 2", "rows 4", "gate/up rows 4", "down rows 4")):
        assert np.array_equal(out, outs[0]), f"{isa} {quant}: {tune} differs from rows 1"


def test_qdot_is_one_typed_switch():
    from freetoken.errors import ConfigError
    defaults = kernels.path_defaults("generic", "q8_0")
    assert kernels.KernelTuning().qdot == "fp32" and kernels.KernelTuning().native_args(1, defaults)[6] == 1
    assert kernels.KernelTuning.parse("qdot=int8").native_args(1, defaults)[6] == 0
    t = kernels.KernelTuning.parse("qdot=fp32,item_kb=64")
    assert (t.qdot, t.item_kb, t.native_args(1, defaults)[6]) == ("fp32", 64, 1)
    assert t.resolved(defaults).qdot == "fp32" and "qdot=fp32" in str(t)
    with pytest.raises(ConfigError, match="qdot='int4' is not one of int8, fp32"):
        kernels.KernelTuning.parse("qdot=int4")


def test_int8_kernels_take_vnni_where_the_cpu_has_it():
    """The int8 kernels' avx512 form (vpdpbusd) runs exactly where the CPU's flags show
    AVX512-VNNI with F, BW, VL and DQ (the H200 host: yes; the CI VM: avx2 only)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line for line in f if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags")
    want = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= flags
    assert kernels.qdot8_has_vnni() == want


def test_slot_pool_with_a_wider_stride_reads_the_same_experts(pools):
    """submit over slots whose stride exceeds the bank's (a cpu tier's slot pool): the layout
    with the pool's stride reads the same quantized bytes."""
    bank, layout, w3 = make_qbank(3, 64, 32, "q4_0", seed=2)
    stride = layout.slot_stride + 4096
    slots = np.zeros((3, stride), np.uint8)
    slots[:, :layout.slot_stride] = bank.reshape(3, -1)
    x = torch.randn(2, 64)
    tok, exp, w = np.array([0, 1, 1], np.int32), np.array([2, 0, 2], np.int32), np.ones(3, np.float32)
    out = set_qdot(pools(1, ISAS[-1]), "fp32").run(x.numpy(), slots.reshape(-1), replace(layout, slot_stride=stride),
                                 tok, exp, w, np.zeros((2, 64), np.float32))
    assert_close(out, reference(x, w3, tok, exp, w), 1e-5, "slot pool")


def test_layouts_refuse_what_the_kernels_cannot_read():
    with pytest.raises(kernels.KernelArgumentError, match="q8_0, q4_0, mxfp4, nvfp4, fp8_e4m3"):
        kernels.ExpertLayout(1 << 20, "bf16", 64, 64, 0, 8192, 16384, "q4_k")
    assert kernels.ExpertLayout(1 << 20, "bf16", 75, 257, 0, 81920, 163840, "fp8_e4m3").D == 75
    with pytest.raises(kernels.KernelArgumentError, match="32-blocks"):
        kernels.ExpertLayout(1 << 20, "bf16", 48, 64, 0, 8192, 16384, "q8_0")
    with pytest.raises(kernels.KernelArgumentError, match="16-blocks"):
        kernels.ExpertLayout(1 << 20, "bf16", 40, 64, 0, 8192, 16384, "nvfp4")
    assert kernels.ExpertLayout(1 << 20, "bf16", 48, 64, 0, 8192, 16384, "nvfp4").D == 48
    lay = kernels.ExpertLayout(1 << 20, "bf16", 64, 96, 0, 8192, 16384, "q4_0")
    assert lay.kernel_dtype == "q4_0"
    assert lay.expert_nbytes == 3 * Q.quant_nbytes("q4_0", (96, 64)) == 3 * (3072 + 384)
    with pytest.raises(kernels.KernelArgumentError, match="past slot_stride"):
        kernels.ExpertLayout(16384 + 100, "bf16", 64, 96, 0, 8192, 16384, "q4_0")


def test_bench_quant_checks_then_prints_one_row_per_type(monkeypatch, capsys):
    import bench_quant
    from freetoken import bandwidth as bw
    from freetoken import profile as prof
    monkeypatch.setitem(bench_quant.SHAPES, "tiny", prof.ExpertShape(256, 128, 4, "bf16", 16, "tiny"))
    monkeypatch.setattr(bw, "MIN_WORKING_SET", 1 << 20)
    monkeypatch.setattr(bw, "llc_bytes", lambda: 1 << 18)
    monkeypatch.setattr("sys.argv", ["bench_quant.py", "--shapes", "tiny", "--threads", "1",
                                     "--seconds", "0.05", "--batches", "1,4"])
    bench_quant.main()
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("tiny ")]
    table = rows[len(rows) // 2:]  # printed as measured, then again as the table
    assert [(r[2], r[3]) for r in table] == [("bf16", "-"), ("q8_0", "int8"), ("q8_0", "fp32"),
                                             ("q4_0", "int8"), ("q4_0", "fp32"), ("mxfp4", "int8"),
                                             ("mxfp4", "fp32"), ("nvfp4", "fp32"),
                                             ("fp8_e4m3", "fp32")]
    assert all(r[4] == "default" for r in table)  # --tunings' column
    assert float(table[0][-2]) == 1.0  # experts/s against bf16's
    assert float(table[0][-1]) < 2e-2  # avx512bf16: bf16 x
    assert all(float(r[-1]) < (3e-2 if r[3] == "int8" else 1e-5) for r in table[1:])
    assert all(float(r[-1]) > 1e-4 for r in table if r[3] == "int8")  # x and h rounded: not the fp32 path
    table = [r for r in table if r[3] != "fp32" or r[2] in ("nvfp4", "fp8_e4m3")]
    mb = [float(r[6]) for r in table]  # MB per expert: q8_0 about half of bf16, 4-bit a quarter
    assert mb[1] / mb[0] == pytest.approx(34 / 64, rel=0.02)
    assert mb[2] / mb[0] == pytest.approx(18 / 64, rel=0.02)
    assert mb[3] / mb[0] == pytest.approx(17 / 64, rel=0.02)  # 16 bytes + an e8m0 per 32
    assert mb[4] / mb[0] == pytest.approx(18 / 64, rel=0.02)  # 8 bytes + an e4m3 per 16
    assert mb[5] / mb[0] == pytest.approx(1 / 2, rel=0.02)  # a byte + an fp32 per 128 x 128


def test_bench_quant_prints_a_row_per_tuning(monkeypatch, capsys):
    """--tunings: each quantized type one row per KernelTuning text over the same bank (bf16 the
    first only); a text KernelTuning refuses stops the bench before any bank is built."""
    import bench_quant
    from freetoken import bandwidth as bw
    from freetoken import profile as prof
    from freetoken.errors import ConfigError
    monkeypatch.setitem(bench_quant.SHAPES, "tiny", prof.ExpertShape(256, 128, 4, "bf16", 16, "tiny"))
    monkeypatch.setattr(bw, "MIN_WORKING_SET", 1 << 20)
    monkeypatch.setattr(bw, "llc_bytes", lambda: 1 << 18)
    argv = ["bench_quant.py", "--shapes", "tiny", "--threads", "1", "--seconds", "0.05", "--batches", "1",
            "--types", "q8_0", "--qdot", "int8"]
    monkeypatch.setattr("sys.argv", argv + ["--tunings", "default;down_rows=2,item_kb=8"])
    bench_quant.main()
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("tiny ")]
    table = rows[len(rows) // 2:]
    assert [(r[2], r[4]) for r in table] == [("bf16", "default"), ("q8_0", "default"),
                                             ("q8_0", "down_rows=2,item_kb=8")]
    monkeypatch.setattr("sys.argv", argv + ["--tunings", "default;down_rows=3"])
    with pytest.raises(ConfigError, match="down_rows=3"):
        bench_quant.main()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_fp8_nan_codes_decode_as_nan(pools, isa, code):
    """e4m3's NaN codes (SPEC.md §9.1) are NaN on every path, in the vector part of a row and in
    its scalar tail (D = 200: the last 8 columns of the second tile), as ftw.quant decodes them;
    a row without one stays finite."""
    for col in (5, 197):
        bank, layout, _ = make_qbank(1, 200, 64, "fp8_e4m3", seed=1)
        bank[layout.offset_gate + 3 * 200 + col] = code  # gate row 3
        assert np.isnan(Q.dequantize(bank[layout.offset_gate:layout.offset_gate + layout.proj_nbytes[0]],
                                     "fp8_e4m3", (64, 200))[3, col])
        x = np.random.default_rng(0).standard_normal((2, 200)).astype(np.float32)
        tok, exp, w = np.array([0], np.int32), np.array([0], np.int32), np.ones(1, np.float32)
        out = set_qdot(pools(1, isa), "fp32").run(x, bank, layout, tok, exp, w, np.zeros((2, 200), np.float32))
        assert np.isnan(out[0]).all() and np.isfinite(out[1]).all(), f"{isa} col {col}"
