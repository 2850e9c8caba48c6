"""A stand-in for experts/vmm.SlotMemory on the cpu (the tests' fixed-address slot storage):
one tensor over the whole reservation, whose bytes past the mapped size read as 0xFF (NaN in
every float dtype), so that a slot read or moved after its unmap shows in the results."""
import torch

UNMAPPED = 0xFF


class HostSlotMemory:
    """max_bytes reserved, [0, nbytes) "mapped"; resize records each call."""

    def __init__(self, max_bytes: int, nbytes: int):
        self.max_bytes, self.nbytes = max_bytes, nbytes
        self.buf = torch.full((max_bytes,), UNMAPPED, dtype=torch.uint8)
        self.calls = []

    def tensor(self) -> torch.Tensor:
        return self.buf

    def resize(self, nbytes: int) -> None:
        assert 0 <= nbytes <= self.max_bytes
        self.calls.append(nbytes)
        if nbytes < self.nbytes:
            self.buf[nbytes:self.nbytes].fill_(UNMAPPED)  # unmapped: its bytes are gone
        else:
            self.buf[self.nbytes:nbytes].fill_(0x5A)  # newly mapped memory is undefined
        self.nbytes = nbytes


def fixed_slots(monkeypatch, max_slots=None):
    """Every ExpertRuntime built after this keeps its slots in a HostSlotMemory of max_slots
    slots (default: all the experts); returns the list the memories are appended to."""
    from freetoken.experts import cache as cache_mod, runtime as runtime_mod
    made = []

    def create(bank_infos, capacity, device):
        stride = max(i.slot_stride for i in bank_infos.values())
        total = sum(i.num_experts for i in bank_infos.values())
        made.append(HostSlotMemory((max_slots or total) * stride, capacity * stride))
        return made[-1], "expert cache slots at a fixed address (the tests' stand-in)"

    monkeypatch.setattr(cache_mod, "create_slot_memory", create)
    monkeypatch.setattr(runtime_mod, "create_slot_memory", create)
    return made
