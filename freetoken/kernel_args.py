"""What a CPU expert kernel call takes, and the checks made on it before native code runs.

Owns ExpertLayout (where one expert's projections and biases sit in a bank slot), ExpertAct
(the activation between them), KernelArgumentError and
the argument checks of CpuExpertPool.submit. Imports no compiled module; freetoken/kernels.py
re-exports every public name here.
"""
from dataclasses import dataclass

import numpy as np

from ftw.quant import quant_nbytes

ACTS = ("silu", "gelu", "gelu_tanh", "clamped_swiglu")
DTYPE_SIZES = {"bf16": 2, "fp16": 2, "fp32": 4}
# quant types (ftw/SPEC.md §9) the CPU kernels read directly (cython/qdot.h)
KERNEL_QUANTS = ("q8_0", "q4_0", "mxfp4", "nvfp4", "fp8_e4m3")
# quant types the device experts' Triton kernels read in place (experts/compute/quant_blocks.py)
DEVICE_QUANTS = ("q8_0", "q4_0", "mxfp4", "fp8_e4m3")


class KernelArgumentError(ValueError):
    """A kernel was called with arrays of the wrong dtype, shape, layout or range (a bug)."""


def _check(cond: bool, msg: str):
    if not cond:
        raise KernelArgumentError(msg)


@dataclass(frozen=True)
class ExpertAct:
    """The activation between an expert's projections: h = act(gate) * up for silu, gelu,
    gelu_tanh; clamped_swiglu (gpt_oss): g = min(gate, limit), u = clamp(up, -limit, limit),
    h = g * sigmoid(alpha * g) * (u + 1). alpha and limit matter to clamped_swiglu only."""
    name: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self):
        _check(self.name in ACTS, f"act must be one of {ACTS}, not {self.name!r}")

    @classmethod
    def from_config(cls, config) -> "ExpertAct":
        """The activation of a ModelConfig's experts (expert_act, swiglu_alpha, swiglu_limit)."""
        return cls(config.expert_act, float(config.swiglu_alpha), float(config.swiglu_limit))


SILU = ExpertAct()


@dataclass(frozen=True)
class ExpertLayout:
    """Where one expert's projections sit inside a bank slot (byte offsets, row-major [out, in]).

    gate [I, D] at offset_gate, up [I, D] at offset_up, down [D, I] at offset_down; slot e of a
    bank starts at e * slot_stride. A biased bank (gpt_oss) also has gate_bias [I], up_bias [I],
    down_bias [D] at their offsets (all three -1: no biases), elements of `dtype`. quant: "none"
    (elements of `dtype`) or one of KERNEL_QUANTS, each weight projection then its SPEC.md §9.2
    bytes (`dtype` is the model's compute dtype, and the biases' dtype).
    """
    slot_stride: int
    dtype: str
    D: int
    I: int
    offset_gate: int
    offset_up: int
    offset_down: int
    quant: str = "none"
    offset_gate_bias: int = -1
    offset_up_bias: int = -1
    offset_down_bias: int = -1

    def __post_init__(self):
        _check(self.dtype in DTYPE_SIZES, f"unknown bank dtype {self.dtype!r}")
        _check(self.D > 0 and self.I > 0, f"bad expert shape D={self.D} I={self.I}")
        _check(self.quant == "none" or self.quant in KERNEL_QUANTS,
               f"the CPU kernels read {', '.join(KERNEL_QUANTS)} experts, not {self.quant!r}")
        k = {"nvfp4": 16, "fp8_e4m3": 1}.get(self.quant, 32)  # cython/qdot.h ft_qk_multiple
        _check(self.quant == "none" or (self.D % k == 0 and self.I % k == 0),
               f"{self.quant} experts need D and I in whole {k}-blocks, not D={self.D} I={self.I}")
        # the fp16 scales; nvfp4's fp32 g, fp8_e4m3's fp32 scales (64-aligned inside the projection)
        align = {"none": DTYPE_SIZES[self.dtype], "mxfp4": 1, "nvfp4": 4, "fp8_e4m3": 4}.get(self.quant, 2)
        for off, nbytes in zip((self.offset_gate, self.offset_up, self.offset_down),
                               self.proj_nbytes):
            _check(off >= 0 and off % align == 0, f"projection offset {off} not {align}-byte aligned")
            _check(off + nbytes <= self.slot_stride,
                   f"projection at {off} runs past slot_stride {self.slot_stride}")
        biases = (self.offset_gate_bias, self.offset_up_bias, self.offset_down_bias)
        _check(all(b < 0 for b in biases) or all(b >= 0 for b in biases),
               f"bias offsets {biases}: all three or none")
        esize = DTYPE_SIZES[self.dtype]
        for off, n in zip(biases, (self.I, self.I, self.D)):
            _check(off < 0 or (off % esize == 0 and off + n * esize <= self.slot_stride),
                   f"bias at {off} misaligned or past slot_stride {self.slot_stride}")

    @property
    def has_bias(self) -> bool:
        return self.offset_gate_bias >= 0

    def native_extra(self, act: ExpertAct, dtype_codes: dict) -> tuple:
        """ft_ffn_extra's fields (cython/ffn.h): alpha, limit, the three bias offsets, the
        biases' dtype as its code in `dtype_codes` (the native module's DTYPE_CODES)."""
        return (act.alpha, act.limit, self.offset_gate_bias, self.offset_up_bias,
                self.offset_down_bias, dtype_codes[self.dtype])

    @property
    def proj_nbytes(self) -> tuple:
        """Bytes of gate, up, down (a quantized projection's blocks and scales)."""
        if self.quant == "none":
            return (self.D * self.I * DTYPE_SIZES[self.dtype],) * 3
        gate = quant_nbytes(self.quant, (self.I, self.D))
        return gate, gate, quant_nbytes(self.quant, (self.D, self.I))

    @property
    def kernel_dtype(self) -> str:
        """The weights' code for the native kernels: the quant type, else the dtype."""
        return self.dtype if self.quant == "none" else self.quant

    @property
    def expert_nbytes(self) -> int:
        """Bytes of weights one expert call reads (gate + up + down)."""
        return sum(self.proj_nbytes)


def layout_from_bank_info(info) -> ExpertLayout:
    """ExpertLayout from an ftw BankInfo (slot_stride, dtype, projections of ProjInfo(name, shape,
    offset, nbytes)); checks that gate/up are [I, D], down [D, I] (biases [I], [I], [D])."""
    projs = {p.name: p for p in info.projections}
    _check(set(projs) >= {"gate", "up", "down"},
           f"bank {getattr(info, 'name', '?')} lacks gate/up/down projections: {sorted(projs)}")
    I, D = (int(s) for s in projs["gate"].shape)
    _check(tuple(projs["up"].shape) == (I, D) and tuple(projs["down"].shape) == (D, I),
           f"expert shapes disagree: gate {projs['gate'].shape} up {projs['up'].shape} "
           f"down {projs['down'].shape}")
    names = ("gate_bias", "up_bias", "down_bias")
    if any(n in projs for n in names):
        shapes = tuple(tuple(projs[n].shape) if n in projs else None for n in names)
        _check(shapes == ((I,), (I,), (D,)), f"expert bias shapes {shapes}, expected "
               f"{((I,), (I,), (D,))}")
    biases = [int(projs[n].offset) if n in projs else -1 for n in names]
    return ExpertLayout(int(info.slot_stride), str(info.dtype), D, I, int(projs["gate"].offset),
                        int(projs["up"].offset), int(projs["down"].offset),
                        str(getattr(info, "quant", "none")), *biases)


def _explain(lay, x, bank, tok, exp, w, out, act):
    """Raise KernelArgumentError naming the first thing wrong with submit's arguments."""
    _check(x.dtype == np.float32 and x.ndim == 2 and x.flags.c_contiguous,
           f"x must be C-contiguous float32 [T, D], got {x.dtype} {x.shape}")
    _check(x.shape[1] == lay.D, f"x has D={x.shape[1]}, the bank's experts D={lay.D}")
    _check(out.dtype == np.float32 and out.shape == x.shape and out.flags.c_contiguous
           and out.flags.writeable, f"out must be writable C-contiguous float32 {x.shape}")
    _check(bank.dtype == np.uint8 and bank.ndim == 1 and bank.flags.c_contiguous,
           "bank must be a contiguous 1-D uint8 array (HostBank.data)")
    _check(bank.nbytes >= lay.slot_stride, f"bank ({bank.nbytes} B) holds no full slot")
    R = tok.shape[0] if tok.ndim == 1 else -1
    for arr, name, dt in ((tok, "token_ids", np.int32), (exp, "expert_ids", np.int32),
                          (w, "weights", np.float32)):
        _check(arr.dtype == dt and arr.ndim == 1 and arr.flags.c_contiguous and arr.shape[0] == R,
               f"{name} must be contiguous {np.dtype(dt).name} [R] with R={R}, got "
               f"{arr.dtype} {arr.shape}")
    _check(isinstance(act, ExpertAct), f"act must be an ExpertAct, not {act!r}")


def _as_array(a, name):
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "numpy"):  # a CPU torch tensor: shares memory
        _check(getattr(a, "device", None) is None or a.device.type == "cpu", f"{name} must be on the CPU")
        return a.numpy()
    raise KernelArgumentError(f"{name} must be a numpy array or CPU tensor, got {type(a).__name__}")
