"""Torch views of host expert banks (ftw.HostBank): one uint8 tensor per MoE layer, and typed
per-projection views of one slot. No copies are made here, except for a quantized bank's
slot_views (ftw/SPEC.md §9), which dequantize.

NOTE: slot layout (docs/INTERFACES.md section 3) comes from the bank's ProjInfo table; nothing
here hard-codes offsets.
"""
import torch

from ftw.quant import dequantize

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def bank_tensor(host_bank) -> torch.Tensor:
    """The whole bank as a uint8 tensor [E * slot_stride] sharing memory with host_bank.data."""
    return torch.from_numpy(host_bank.data)


def slot_views(slot: torch.Tensor, info) -> dict:
    """Typed views {'gate': [I, D], 'up': [I, D], 'down': [D, I]} into one slot's bytes.

    `slot` is a uint8 tensor of at least info.slot_stride bytes (a host slot or a device cache
    slot); `info` is the bank's BankInfo. A quantized bank (info.quant): fp32 copies of the
    dequantized weight projections, from a CPU slot (ftw.quant, the kernels' oracle: the torch
    reference paths; the native kernels read the quantized bytes themselves); its biases (gpt_oss)
    are typed views as in any bank.
    """
    quant = getattr(info, "quant", "none")
    dtype = TORCH_DTYPES[info.dtype]
    views = {}
    for p in info.projections:
        raw = slot[p.offset:p.offset + p.nbytes]
        if quant != "none" and len(p.shape) == 2:  # weights; biases [I] / [D] are never quantized
            views[p.name] = torch.from_numpy(dequantize(raw.numpy(), quant, p.shape))
        else:
            views[p.name] = raw.view(dtype).view(*p.shape)
    return views


def expert_slot(bank: torch.Tensor, info, expert: int) -> torch.Tensor:
    """Bytes of one (layer, expert) slot: bank[expert * slot_stride : (expert + 1) * slot_stride]."""
    start = expert * info.slot_stride
    return bank[start:start + info.slot_stride]


def pool_views(storage: torch.Tensor, info) -> dict:
    """Typed views {'gate': [C, I, D], 'up': [C, I, D], 'down': [D, I] per slot -> [C, D, I]} of
    every slot of a slot pool uint8 [C, stride] (stride >= info.slot_stride, a multiple of the
    dtype size): views[name][s] is slot_views(storage[s], info)[name], one select instead of
    three view ops per projection. No copies, so no quantized bank (its projections are blocks
    and scales, not elements: the native kernels read such a pool on the cpu device, and
    pool_bytes gives the device kernels theirs)."""
    if getattr(info, "quant", "none") != "none":
        raise ValueError(f"{info.name} is {info.quant}: its slots have no typed views")
    dtype = TORCH_DTYPES[info.dtype]
    C = storage.shape[0]
    views = {}
    for p in info.projections:
        raw = storage[:, p.offset:p.offset + p.nbytes]  # [C, nbytes], row stride = stride
        views[p.name] = raw.view(dtype).view(C, *p.shape)
    return views


def pool_bytes(storage: torch.Tensor, info) -> dict:
    """pool_views for a quantized bank (ftw/SPEC.md §9): each projection's bytes, blocks then
    scales, {'gate': [C, nbytes], 'up': ..., 'down': ...} uint8 of a slot pool uint8 [C, stride]
    (no copies); the device kernels read them (experts/compute/quant_blocks.py)."""
    return {p.name: storage[:, p.offset:p.offset + p.nbytes] for p in info.projections}
