"""Torch views of host expert banks (ftw.HostBank): one uint8 tensor per MoE layer, and typed
per-projection views of one slot. No copies are made here.

NOTE: slot layout (docs/INTERFACES.md section 3) comes from the bank's ProjInfo table; nothing
here hard-codes offsets.
"""
import torch

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def bank_tensor(host_bank) -> torch.Tensor:
    """The whole bank as a uint8 tensor [E * slot_stride] sharing memory with host_bank.data."""
    return torch.from_numpy(host_bank.data)


def slot_views(slot: torch.Tensor, info) -> dict:
    """Typed views {'gate': [I, D], 'up': [I, D], 'down': [D, I]} into one slot's bytes.

    `slot` is a uint8 tensor of at least info.slot_stride bytes (a host slot or a device cache
    slot); `info` is the bank's BankInfo.
    """
    dtype = TORCH_DTYPES[info.dtype]
    views = {}
    for p in info.projections:
        raw = slot[p.offset:p.offset + p.nbytes]
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
    three view ops per projection. No copies."""
    dtype = TORCH_DTYPES[info.dtype]
    C = storage.shape[0]
    views = {}
    for p in info.projections:
        raw = storage[:, p.offset:p.offset + p.nbytes]  # [C, nbytes], row stride = stride
        views[p.name] = raw.view(dtype).view(C, *p.shape)
    return views
