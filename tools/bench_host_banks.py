"""Expert banks of the MoE benches (bench_moe_setup.py) built in host memory, no FTW file: one
anonymous mapping (page-aligned, transparent huge pages asked for) holding every layer's bank
back to back in the docs/INTERFACES.md section 3 slot layout; filled by a thread pool with
small random bf16 values (a 2 MiB block XOR-ed with shifted noise in the low mantissa bits, so
no two pages are alike: VMs merge identical pages), then pinned on cuda (cudaHostRegister per
layer bank, as the engine does). Also how much of the process sits in huge pages (huge_bytes).
quant (issue 35): the banks in that type's slot layout and bytes, as `convert --quant` writes
them for these bf16 experts (bench_quant_banks.py).
"""
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

import bench_quant_banks as qb
from ftw.reader import BankInfo, HostBank, ProjInfo
from freetoken import bandwidth as bw
from freetoken import profile
from freetoken.config import ModelConfig
from freetoken.kernel_args import layout_from_bank_info

GB = 1e9


class HostBanks:
    """.banks {layer: HostBank}, views of one mapping; .pin() / .close() on cuda; .layout
    (freetoken.kernels.ExpertLayout), .slot_bytes, .layer_bytes, .total_bytes, .build_s,
    .quant ("bf16" or the banks' quant type, bench_quant_banks.QUANTS), .exact_slots and
    .exact_s (quantized banks: slots quantized by ftw/quant.py, the rest noisy copies of them,
    and the seconds of that part of build_s)."""

    def __init__(self, mc: ModelConfig, threads=None, seed=0, quant="bf16"):
        lay = bw.synthetic_layout(profile.ExpertShape(
            mc.hidden_size, mc.moe_intermediate_size, mc.num_experts_per_tok, "bf16", mc.num_experts))
        E = mc.num_experts
        n = lay.D * lay.I * 2
        projs = (ProjInfo("gate", (lay.I, lay.D), lay.offset_gate, n),
                 ProjInfo("up", (lay.I, lay.D), lay.offset_up, n),
                 ProjInfo("down", (lay.D, lay.I), lay.offset_down, n))
        bf16 = BankInfo(0, "blk.0.ffn_exps", 0, E, lay.slot_stride, "bf16", projs, ())
        slot = qb.quant_info(bf16, qb.check_quant(quant))  # the slot layout of every layer
        self.quant, self.exact_slots, self.exact_s = quant, 0, 0.0
        self.layout = lay if quant == "bf16" else layout_from_bank_info(slot)
        self.slot_bytes = slot.slot_stride
        self.layer_bytes = E * slot.slot_stride
        self.total_bytes = len(mc.moe_layers) * self.layer_bytes
        t0 = time.perf_counter()
        self._map = mmap.mmap(-1, self.total_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self.data = np.frombuffer(self._map, dtype=np.uint8)  # [L * E * slot_stride]
        threads = threads or os.cpu_count()
        if quant == "bf16":
            _fill(self.data, threads, seed)
        else:
            self.exact_slots, self.exact_s = qb.fill_quantized(
                [self.data.reshape(-1, self.slot_bytes)], bf16, slot,
                lambda k: bf16_slots(bf16, k, seed), seed, threads)
        self.build_s = time.perf_counter() - t0
        self.huge_bytes = huge_bytes()  # (this process's; the banks are nearly all of it)
        self.banks = {}
        for i, layer in enumerate(mc.moe_layers):
            info = BankInfo(layer, f"blk.{layer}.ffn_exps", i * self.layer_bytes, E,
                            slot.slot_stride, "bf16", slot.projections, (), 0, slot.quant)
            self.banks[layer] = HostBank(info, self.data[i * self.layer_bytes:(i + 1) * self.layer_bytes])
        self._pinned, self.pin_s = [], 0.0

    def pin(self) -> None:
        """cudaHostRegister each layer's bank (as the engine pins FTW banks), so fills and
        layer streaming are async DMA copies."""
        t0 = time.perf_counter()
        for b in self.banks.values():
            err = torch.cuda.cudart().cudaHostRegister(b.data.ctypes.data, b.data.nbytes, 0)
            if int(err) != 0:
                self.close()
                raise RuntimeError(f"cudaHostRegister of a {b.data.nbytes / GB:.2f} GB bank failed "
                                   f"({err}); raise the locked-memory limit (ulimit -l) or use smaller shapes")
            self._pinned.append(b.data)
        self.pin_s = time.perf_counter() - t0
        self.huge_bytes = huge_bytes()

    @property
    def pinned(self) -> bool:
        return bool(self._pinned)

    def close(self) -> None:
        for data in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(data.ctypes.data)
        self._pinned = []


class FileBanks(HostBanks):
    """HostBanks' interface over a synthetic model's banks (bench_shapes.SyntheticFile, any
    family and shape): one buffer per layer as the engine has them, built here; .data is the
    first layer's bank (what the benches' bandwidth checks read); .file is the model."""

    def __init__(self, file):
        from freetoken.kernel_args import layout_from_bank_info
        self.file = file
        self.banks = file.load_banks()
        self.build_s = file.build_s
        first = next(iter(self.banks.values()))
        self.layout = layout_from_bank_info(first.info)
        self.slot_bytes = first.info.slot_stride
        self.layer_bytes = first.info.nbytes
        self.total_bytes = sum(b.info.nbytes for b in self.banks.values())
        self.data = first.data
        self.quant = getattr(file, "quant", "bf16")
        self.exact_slots, self.exact_s = getattr(file, "exact", (0, 0.0))
        self.huge_bytes = huge_bytes()
        self._pinned, self.pin_s = [], 0.0


def huge_bytes() -> int:
    """Bytes of this process's anonymous memory in transparent huge pages (-1 if unknown). On the
    H200 host 4 KiB pages cost a 1-expert CPU job ~5% (docs/MEASUREMENTS.md#cpu-kernel-on-a-gpu-host)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


MAP_HUGETLB, MAP_HUGE_1GB, GIB = 0x40000, 30 << 26, 1 << 30
HUGE_1G = "/sys/kernel/mm/hugepages/hugepages-1048576kB"


def hugetlb_map(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of nbytes rounded up to whole 1 GiB hugetlb pages (the kernel
    takes them from the reserved pool at mmap time, so it fails here, not at first touch)."""
    n = -(-nbytes // GIB) * GIB
    try:
        return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_HUGETLB | MAP_HUGE_1GB)
    except OSError as e:
        try:
            with open(f"{HUGE_1G}/free_hugepages") as f:
                free = f.read().strip()
        except OSError:
            free = "unknown (no 1 GiB page support)"
        raise RuntimeError(f"mapping {n // GIB} 1 GiB pages failed ({e.strerror}); free: {free}. "
                           f"Reserve them first, as root: echo {n // GIB} > {HUGE_1G}/nr_hugepages") from None


def bf16_slots(info: BankInfo, n: int, seed: int) -> np.ndarray:
    """The first n slots of the bf16 banks HostBanks(quant="bf16") builds with `seed` (_fill's
    values depend on the word offset alone), as uint16 [n, slot_stride / 2]."""
    data = np.zeros(n * info.slot_stride, np.uint8)
    _fill(data, 1, seed)
    return data.view(np.uint16).reshape(n, -1)


def _fill(data: np.ndarray, threads: int, seed: int) -> None:
    """Small random bf16 values (std 0.02), every 2 MiB block with its own noise shift."""
    n = 1 << 20  # uint16 words per block
    gen = torch.Generator().manual_seed(seed)
    block = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    noise = np.random.default_rng(seed).integers(0, 8, 2 * n, dtype=np.uint16)
    words = data[: data.size // 2 * 2].view(np.uint16)
    per_task = 32 * n  # 64 MiB per task

    def task(start):
        for off in range(start, min(start + per_task, words.size), n):
            m = min(n, words.size - off)
            shift = (off // n * 2731) % n
            np.bitwise_xor(block[:m], noise[shift:shift + m], out=words[off:off + m])

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(task, range(0, words.size, per_task)))


def banks_line(hb: HostBanks) -> str:
    pin = f", pinned (cudaHostRegister) in {hb.pin_s:.1f} s" if hb.pinned else ""
    if hb.huge_bytes >= 0:
        pin += f"; {hb.huge_bytes / GB:.2f} GB of the process in huge pages"
    quant = ""
    if hb.quant != "bf16":
        quant = (f"; {hb.quant} as convert --quant writes it: {hb.exact_slots} slots quantized by "
                 f"ftw/quant.py in {hb.exact_s:.1f} s, the others noisy copies of them "
                 f"(bench_quant_banks.py)")
    return (f"host banks built in memory, not from an FTW file (the GPU host has 125 GiB RAM and "
            f"64 GB disk: a 58 GB FTW file plus its loaded banks does not fit comfortably): "
            f"{hb.total_bytes / GB:.2f} GB allocated and filled in {hb.build_s:.1f} s "
            f"({hb.total_bytes / GB / max(hb.build_s, 1e-9):.1f} GB/s){pin}{quant}")
