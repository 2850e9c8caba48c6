"""Quantized synthetic expert banks: the slot bytes `freetoken convert --quant TYPE` writes for
random bf16 experts, built in memory at copy speed, for `freetoken profile` (bandwidth.py's
synthetic_bank of a quantized layout) and the benches in tools/ (bench_quant_banks.py). Measures
nothing itself.

The first TEMPLATE_SLOTS slots are bf16 slots quantized by ftw/quant.py (convert's quantizer:
byte for byte what convert writes for those weights); every later slot is a copy of template
slot s mod K whose element bytes are XOR-ed with random noise from a per-slot offset and whose
block scales' lowest bit moves at random (never inf, NaN or e8m0's 255), so no two pages are
alike (VMs merge identical pages) and every value stays one the type encodes: a bank of any size
builds at copy speed, not at the reference quantizer's rate
(docs/MEASUREMENTS.md#quantized-experts-the-show-benches-issue-35). ELEMENT_MASK says which
element bits move.
"""
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from ftw import constants as C
from ftw import quant as Q
from ftw.layout import BankEntry
from ftw.reader import BankInfo, ProjInfo

from .errors import ConfigError

TEMPLATE_SLOTS = 16  # slots quantized exactly; the rest are noisy copies of them
NOISE_BYTES = 1 << 20  # extra noise past the longest element region (the per-slot offsets)
# bits of each element byte the noise may flip, keeping every code valid: any nibble is a q4_0 /
# e2m1 code; fp8_e4m3 flips the sign only (0x7f / 0xff are NaN); q8_0 flips two low bits, then
# -128 (not a GGUF Q8_0 code: the kernels' sign trick needs |q| <= 127) is clamped to -127
ELEMENT_MASK = {"q8_0": 0x06, "q4_0": 0x11, "mxfp4": 0x11, "nvfp4": 0x11, "fp8_e4m3": 0x80}
# a block scale's lowest bit: fp16 / fp32 scales flip their mantissa's last bit (at most 2^-10
# of the scale; scales from bf16 weights have it clear, so flipping sets it), 1-byte scales
# (e8m0, e4m3) only clear it, halving an e8m0 scale: setting it could make 255 / 0x7f (NaN)


def quant_info(info: BankInfo, quant: str, offset: int = 0) -> BankInfo:
    """The BankInfo convert writes (ftw.layout.BankEntry) for bf16 bank `info`'s experts
    quantized as `quant`, at `offset`; `info` itself for bf16 ("none")."""
    if quant in ("bf16", C.QUANT_NONE):
        return info
    projs = {p.name: p for p in info.projections}
    I, D = projs["gate"].shape
    entry = BankEntry(info.layer, info.dtype, info.num_experts, I, D, read_expert=None, quant=quant,
                      has_bias="gate_bias" in projs)
    return BankInfo(info.layer, info.name, offset, info.num_experts, entry.slot_stride, info.dtype,
                    tuple(ProjInfo(p["name"], tuple(p["shape"]), p["offset"], p["nbytes"])
                          for p in entry.projections), (0,) * info.num_experts, info.file, quant)


def element_regions(info: BankInfo) -> list:
    """[(start, stop)] of a quantized slot's element bytes (each weight's qs, ftw/SPEC.md §9.2)."""
    out = []
    for p in info.projections:
        if p.name not in C.BIAS_PROJECTIONS:
            out.append((p.offset, p.offset + Q.regions(info.quant, p.shape).qs_nbytes))
    return out


def scale_regions(info: BankInfo) -> list:
    """[(start, stop)] of a quantized slot's block scales (each weight's, ftw/SPEC.md §9.2; not
    nvfp4's tensor scale g)."""
    q, out = Q.quant_type(info.quant), []
    for p in info.projections:
        if p.name not in C.BIAS_PROJECTIONS:
            r = Q.regions(info.quant, p.shape)
            start = p.offset + r.scales_offset
            out.append((start, start + r.scales_shape[0] * r.scales_shape[1] * q.scale_bytes))
    return out


def quantize_slot(words: np.ndarray, src: BankInfo, dst: BankInfo, out: np.ndarray) -> None:
    """One bf16 slot (uint16 bits, src's layout) -> its `dst.quant` bytes in `out` (uint8, dst's
    slot_stride): each weight as convert's read_quantized (ftw.quant.quantize of its fp32
    values), biases copied as they are, padding zero."""
    raw = words.view(np.uint8)
    srcp = {p.name: p for p in src.projections}
    out[:] = 0
    for p in dst.projections:
        s = srcp[p.name]
        if p.name in C.BIAS_PROJECTIONS:
            out[p.offset:p.offset + p.nbytes] = raw[s.offset:s.offset + s.nbytes]
            continue
        bits = raw[s.offset:s.offset + s.nbytes].view(np.uint16).astype(np.uint32) << 16
        values = bits.view(np.float32).reshape(s.shape)
        out[p.offset:p.offset + p.nbytes] = np.frombuffer(Q.quantize(values, dst.quant), np.uint8)


def fill_quantized(banks: list, src: BankInfo, dst: BankInfo, bf16_slots: Callable, seed: int,
                   threads: int = None, done: Callable = None) -> tuple:
    """Fill `banks` ([uint8 [E, dst.slot_stride]] in layer order: global slot s is row s of their
    concatenation) as the module docstring says. bf16_slots(n) -> uint16 [n, src.slot_stride / 2]:
    the bf16 banks' first n slots. done(i), when given, runs on the calling thread once bank i
    is filled (in order). Returns (slots quantized exactly, seconds they took)."""
    threads = threads or os.cpu_count() or 1
    total = sum(b.shape[0] for b in banks)
    K = min(total, TEMPLATE_SLOTS)
    words = bf16_slots(K)
    template = np.empty((K, dst.slot_stride), np.uint8)
    regions, scales = element_regions(dst), scale_regions(dst)
    rng = np.random.default_rng(seed)
    noise = rng.integers(0, 256, max(b - a for a, b in regions) + NOISE_BYTES, dtype=np.uint8)
    noise &= ELEMENT_MASK[dst.quant]
    # bit 0 of each scale's lowest byte (little-endian) moves or not; its other bytes stay
    size = Q.quant_type(dst.quant).scale_bytes
    bits = rng.integers(0, 2, (max(b - a for a, b in scales) + NOISE_BYTES) // size, dtype=np.uint8)
    bits = np.pad(bits[:, None], ((0, 0), (0, size - 1))).reshape(-1)
    scale_noise = (np.bitwise_xor, bits) if size > 1 else (np.bitwise_and, 0xFF ^ bits)
    with ThreadPoolExecutor(threads, thread_name_prefix="quant-fill") as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda k: quantize_slot(words[k], src, dst, template[k]), range(K)))
        template_s = time.perf_counter() - t0
        pending, first = [], 0
        for bank in banks:
            per_task = max(1, (32 << 20) // dst.slot_stride)
            pending.append([pool.submit(_copy_slots, template, bank[e:e + per_task], first + e,
                                        regions, noise, scales, scale_noise, dst.quant)
                            for e in range(0, bank.shape[0], per_task)])
            first += bank.shape[0]
        for i, futures in enumerate(pending):
            for f in futures:
                f.result()
            if done is not None:
                done(i)
    return K, template_s


def _copy_slots(template, rows, first_slot, regions, noise, scales, scale_noise, quant) -> None:
    K, (scale_op, scale_bits) = template.shape[0], scale_noise
    for i, row in enumerate(rows):
        s = first_slot + i
        np.copyto(row, template[s % K])
        if s < K:
            continue  # a template slot: convert's bytes exactly
        start = (s * 4099) % (NOISE_BYTES // 4) * 4  # each slot its own window; whole scales
        for a, b in regions:
            np.bitwise_xor(row[a:b], noise[start:start + b - a], out=row[a:b])
            if quant == "q8_0":
                q = row[a:b].view(np.int8)
                np.maximum(q, -127, out=q)
        for a, b in scales:
            scale_op(row[a:b], scale_bits[start:start + b - a], out=row[a:b])


def plain_info(D: int, I: int, num_experts: int, has_bias: bool = False) -> BankInfo:
    """The BankInfo of a bf16 bank of num_experts experts (gate, up [I, D], down [D, I], with
    biases when has_bias) as convert writes it (ftw.layout.BankEntry)."""
    entry = BankEntry(0, "bf16", num_experts, I, D, read_expert=None, has_bias=has_bias)
    return BankInfo(0, "blk.0.ffn_exps", 0, num_experts, entry.slot_stride, "bf16",
                    tuple(ProjInfo(p["name"], tuple(p["shape"]), p["offset"], p["nbytes"])
                          for p in entry.projections), (0,) * num_experts)


def synthetic_quant_bank(layout, num_experts: int, plain_bank: Callable, seed: int = 0,
                         threads: int = None) -> np.ndarray:
    """num_experts page-aligned slots of quantized ExpertLayout `layout` (D, I, biases, quant)
    filled as the module docstring says from random bf16 experts: plain_bank(bf16 layout, n) ->
    uint8 bank of n slots (bandwidth.synthetic_bank, which calls this for quantized layouts).
    ConfigError when convert's slot of that shape and type differs from `layout` (biases of
    another dtype than bf16)."""
    from .kernel_args import layout_from_bank_info
    src = plain_info(layout.D, layout.I, num_experts, layout.has_bias)
    dst = quant_info(src, layout.quant)
    got = layout_from_bank_info(dst)
    where = lambda lay: (lay.slot_stride, lay.offset_gate, lay.offset_up, lay.offset_down,
                         lay.offset_gate_bias, lay.offset_up_bias, lay.offset_down_bias)
    if where(got) != where(layout):
        raise ConfigError(f"a synthetic {layout.quant} bank is built from bf16 experts, and its slot "
                          f"{where(got)} is not this {layout.dtype} one's {where(layout)}: measure "
                          f"with `freetoken profile --quant {layout.quant}` instead")
    K = min(num_experts, TEMPLATE_SLOTS)
    plain = plain_bank(layout_from_bank_info(src), K)
    total = num_experts * dst.slot_stride
    raw = np.empty(total + 4096, np.uint8)
    start = (-raw.ctypes.data) % 4096
    bank = raw[start:start + total]
    fill_quantized([bank.reshape(num_experts, -1)], src, dst,
                   lambda k: plain[:k * src.slot_stride].view(np.uint16).reshape(k, -1), seed, threads)
    return bank
