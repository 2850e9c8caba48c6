"""Zero-copy fills (cuda with Triton): one kernel copies a layer step's planned fills from the
pinned host bank into their cache slots, reading host memory over PCIe through its mapped
device address (unified addressing: a pinned or cudaHostRegister'ed host pointer is valid on
the GPU as it is). Which expert goes to which slot is data the kernel reads (a small index
buffer), so a captured decode step (graph_step.py) does its fills inside the layer's expert
graph B_l: the host writes the fill list into a pinned buffer and replays B_l, with no copy
call per fill, no copy stream and no events on the step's critical path.

  gather   grid (F, n / BLOCK): for fill f with src[f] >= 0, words [b*BLOCK, (b+1)*BLOCK) of
           host expert src[f] -> cache slot dst[f]; src[f] = -1 (no fill) reads and writes
           nothing
  gather(programs=G)
           grid (F, G): each program loops over every G-th block of its fill. Few programs
           keep few SMs and few PCIe reads in flight: a background copy (admissions,
           captured/control.py) that takes the link's idle time and yields most of it to a full
           gather running beside it, which has hundreds of programs' reads in flight
           (docs/MEASUREMENTS.md#admission-gather).

Bytes move as 4-byte words (slot strides are multiples of 4). The gather reads host memory
nearly as fast as the copy engine's pinned copies; what it saves is the host's per-fill work
(docs/MEASUREMENTS.md#fills-zero-copy-gather-vs-copy-engine).
"""
import torch


try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: fills stay copies on the copy stream (fills.py)
    triton = None

BLOCK = 4096  # words per program: 16 KiB of one expert


def available() -> bool:
    return triton is not None


def enabled(device, cuda_graphs: bool = True) -> bool:
    """Whether decode fills on `device` are zero-copy: cuda, Triton and captured decode steps
    (the gather runs inside them). The hybrid split then uses the bandwidths measured for this
    path (profile.py)."""
    return (str(getattr(device, "type", device)).startswith("cuda") and cuda_graphs
            and available())


class MappedHost:
    """A pinned host tensor as a Triton kernel argument: its address (which the GPU can read,
    unified addressing) and element type; keeps the tensor alive."""

    def __init__(self, t: torch.Tensor):
        self.tensor, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()


def host_words(host_bank: torch.Tensor, num_experts: int, stride: int):
    """The layer's host bank [E * stride] uint8 as int32 words for gather(): mapped on cuda (a
    pinned bank), the tensor itself on the cpu (Triton's interpreter, tests)."""
    words = host_bank[:num_experts * stride].view(torch.int32)
    return MappedHost(words) if not words.is_cuda and words.is_pinned() else words


if triton is not None:
    @triton.jit
    def _gather(src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, n_words, src_stride, dst_stride,
                BLOCK: tl.constexpr):
        f = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        e = tl.load(src_idx_ptr + f)
        s = tl.load(dst_idx_ptr + f)
        ok = (offs < n_words) & (e >= 0)  # no fill: every lane masked, nothing read
        v = tl.load(src_ptr + e.to(tl.int64) * src_stride + offs, mask=ok)
        tl.store(dst_ptr + s.to(tl.int64) * dst_stride + offs, v, mask=ok)

    @triton.jit
    def _gather_loop(src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, n_words, src_stride, dst_stride,
                     N_ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
        f = tl.program_id(0)
        e = tl.load(src_idx_ptr + f)
        s = tl.load(dst_idx_ptr + f)
        src = src_ptr + e.to(tl.int64) * src_stride
        dst = dst_ptr + s.to(tl.int64) * dst_stride
        if e >= 0:  # no fill: nothing read
            for i in range(N_ROUNDS):  # block i * G + g of the fill (a constant: one per model)
                offs = (i * tl.num_programs(1) + tl.program_id(1)) * BLOCK + tl.arange(0, BLOCK)
                ok = offs < n_words
                tl.store(dst + offs, tl.load(src + offs, mask=ok), mask=ok)


def gather(src_words, storage_words: torch.Tensor, src_idx: torch.Tensor,
           dst_idx: torch.Tensor, stride: int, programs: int = None) -> None:
    """Copy host expert src_idx[f] (slot stride `stride` bytes) into cache slot dst_idx[f] for
    every f with src_idx[f] >= 0. src_words: host_words(); storage_words: the slot pool as
    int32 [C, slot_stride / 4]; src_idx, dst_idx: int64 [F] on the pool's device. programs:
    None = one program per block (the fastest alone); G = G looping programs per fill (the
    module docstring)."""
    if stride % 4 or storage_words.dtype != torch.int32:
        raise ValueError(f"zero-copy fills move 4-byte words: slot stride {stride} must be a "
                         f"multiple of 4 and the pool an int32 view")
    n = stride // 4
    F = src_idx.shape[0]
    if programs:
        G = int(programs)
        _gather_loop[(F, G)](src_words, storage_words, src_idx, dst_idx, n, n,
                             storage_words.stride(0), N_ROUNDS=triton.cdiv(n, G * BLOCK),
                             BLOCK=BLOCK)
        return
    _gather[(F, triton.cdiv(n, BLOCK))](src_words, storage_words, src_idx, dst_idx, n, n,
                                        storage_words.stride(0), BLOCK=BLOCK)
