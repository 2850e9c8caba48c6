"""ExpertCache, the mechanism: one global pool of `capacity` slots shared by every MoE layer,
the residency table [layer, expert] -> slot, the owner of each slot and its last-used stamp.
It records where experts live and moves bytes into slots; which slot to evict is the policy's
choice (policy.py), and which misses to fill is the plan's (plan.py).

Slot storage is one uint8 tensor [capacity, slot_stride] on the compute device (cuda), or a
separate CPU tensor (the cpu "device tier"). On cuda it sits at a fixed address where the
driver allows (vmm.py: create_slot_memory): [max_slots, slot_stride] of reserved addresses,
only the first `capacity` slots backed, so a resize moves no graph's pointers. A slot holds
the raw bytes of one host-bank slot (docs/INTERFACES.md section 3), so bank.slot_views works
on it unchanged; a quantized bank's slot holds its quantized bytes (ftw/SPEC.md §9.2), which
the CPU kernels read as they read the bank (the fills copy them unchanged; nothing is
dequantized into a slot).
"""
import math

import numpy as np
import torch

from . import vmm
from ..errors import ConfigError

GB = 1e9  # --expert-cache-gb counts decimal gigabytes, like the GB/s figures we print


def cache_capacity(engine_config, bank_infos: dict, device) -> int:
    """Number of slots from --expert-cache-gb / --expert-cache-frac. Neither given: 0 on the
    cpu device; on cuda, what fits in the free GPU memory less a reserve for activations and
    the KV cache (max(2 GB, 20% of the GPU)): a runtime built alone; the engine's memory plan
    (memory_plan.py) sizes the default from what its context leaves instead. Raises ConfigError
    when the asked size is larger than all the model's experts."""
    total = sum(i.num_experts for i in bank_infos.values())
    stride = max((i.slot_stride for i in bank_infos.values()), default=4096)
    if engine_config.expert_cache_frac is not None:
        return min(total, math.floor(engine_config.expert_cache_frac * total + 1e-9))
    if engine_config.expert_cache_gb is not None:
        capacity = math.floor(engine_config.expert_cache_gb * GB / stride)
        if capacity > total:
            max_gb = math.floor(total * stride / GB * 1e6) / 1e6
            raise ConfigError(
                f"--expert-cache-gb {engine_config.expert_cache_gb:g} is larger than all the "
                f"model's experts ({total} experts, {max_gb:g} GB); use --expert-cache-gb "
                f"{max_gb:g} or less, or --expert-cache-frac 1 to cache every expert")
        return capacity
    if torch.device(device).type != "cuda":
        return 0
    free, whole = torch.cuda.mem_get_info(torch.device(device))
    spare = free - max(2 * GB, 0.2 * whole)
    return max(0, min(total, int(spare // stride)))


def create_slot_memory(bank_infos: dict, capacity: int, device):
    """(vmm.SlotMemory or None, words for the log): on cuda, fixed-address slot memory holding
    `capacity` slots, reserved for as many slots as the GPU's whole memory or all the experts
    (the most a resize can ask); None elsewhere (the cpu device) and where the driver's virtual
    memory API is missing or fails (then the storage is allocated again at every resize and the
    captured decode graphs with it). Chosen once, at start."""
    if torch.device(device).type != "cuda":
        return None, ""
    total = sum(i.num_experts for i in bank_infos.values())
    stride = max((i.slot_stride for i in bank_infos.values()), default=0)
    why = vmm.unavailable_reason(device)
    if not why and stride:
        whole = torch.cuda.get_device_properties(torch.device(device)).total_memory
        max_slots = min(total, whole // stride)
        try:
            memory = vmm.SlotMemory(device, max_slots * stride, capacity * stride)
            memory.tensor()  # torch takes the range as a tensor (or the fallback runs)
            return memory, (f"expert cache slots at a fixed address ({memory.max_bytes / GB:.1f} "
                            "GB reserved): resizes keep the captured decode graphs")
        except RuntimeError as e:  # vmm.VmmError, or torch refusing the range
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
    return None, (f"expert cache slots reallocated at each resize ({why or 'no slots'}): "
                  "resizes capture the decode graphs again")


class ExpertCache:
    """Contract: after every public method, check_integrity() holds. Stamps are unique: the
    clock advances once per touched slot, and empty slots start below every real stamp.

    The books are int64 torch CPU tensors `residency` [L, E] (slot or -1), `owner` [C, 2]
    ((layer, expert) or -1, -1) and `last_used` [C], sharing memory with numpy arrays that the
    host-side planner reads (per-element torch indexing costs microseconds; a later GPU-resident
    control mirrors the tensors on the device).
    """

    def __init__(self, bank_infos: dict, capacity: int, device="cpu", with_storage: bool = True,
                 memory=None):
        """memory: fixed-address slot memory (create_slot_memory's vmm.SlotMemory; the tests
        pass a stand-in with the same max_bytes, resize(nbytes), tensor()) holding `capacity`
        slots: `storage` is then [max_slots, slot_stride] at its address for good, slots >=
        capacity unbacked, and resize maps and unmaps at its tail. None: a plain tensor."""
        total = sum(i.num_experts for i in bank_infos.values())
        if not 0 <= capacity <= total:
            raise ConfigError(f"the expert cache must hold between 0 and {total} experts "
                              f"(every expert of the model), not {capacity}")
        self.capacity = capacity
        self.num_experts_total = total
        self.slot_stride = max((i.slot_stride for i in bank_infos.values()), default=0)
        num_layers = max(bank_infos, default=-1) + 1
        max_experts = max((i.num_experts for i in bank_infos.values()), default=0)
        self.res = np.full((num_layers, max_experts), -1, dtype=np.int64)  # [L, E]
        self.own = np.full((capacity, 2), -1, dtype=np.int64)  # [C, (layer, expert)]
        self.stamps = np.arange(capacity, dtype=np.int64) - capacity  # [C]
        self.residency = torch.from_numpy(self.res)
        self.owner = torch.from_numpy(self.own)
        self.last_used = torch.from_numpy(self.stamps)
        self.clock = 0
        self.device = torch.device(device)
        self.storage = None
        self.memory = memory if with_storage else None
        self.max_slots = capacity  # the most slots a resize keeps the storage's address for
        if self.memory is not None:
            self.max_slots = min(total, self.memory.max_bytes // max(self.slot_stride, 1))
            assert self.memory.nbytes >= capacity * self.slot_stride <= self.memory.max_bytes
            raw = self.memory.tensor()[:self.max_slots * self.slot_stride]
            self.storage = raw.view(self.max_slots, self.slot_stride)  # [max_slots, slot_stride]
            self.storage[:capacity].zero_()  # (as below)
        elif with_storage:
            # zeros, not empty: a captured step computes padding routes on slot 0 at weight 0
            # (graph_step.py), which must not hold NaN bits before its first fill
            self.storage = torch.zeros((capacity, self.slot_stride), dtype=torch.uint8,
                                       device=self.device)  # [C, slot_stride]
        self.stats = {"hits": 0, "misses": 0, "fills": 0, "evictions": 0}

    @property
    def fixed_address(self) -> bool:
        """Whether `storage` keeps its address across resizes (captured graphs stay valid)."""
        return self.memory is not None

    def num_resident(self) -> int:
        return int((self.own[:, 0] >= 0).sum())

    def lookup(self, layer: int, experts: list) -> list:
        """Slot of each (layer, expert), -1 where absent."""
        return self.res[layer, experts].tolist() if experts else []

    def touch(self, slots: list) -> None:
        """Mark slots used now, in this order (the last one is the most recent)."""
        n = len(slots)
        if n:
            self.stamps[slots] = np.arange(self.clock + 1, self.clock + n + 1)
            self.clock += n

    def assign(self, slot: int, layer: int, expert: int) -> tuple:
        """Make `slot` the home of (layer, expert); returns the (layer, expert) it evicted or
        (-1, -1). The bytes are copied by the caller (see slot())."""
        old_layer, old_expert = int(self.own[slot, 0]), int(self.own[slot, 1])
        if self.res[layer, expert] >= 0:
            raise ValueError(f"expert ({layer}, {expert}) is already resident")
        if old_layer >= 0:
            self.res[old_layer, old_expert] = -1
            self.stats["evictions"] += 1
        self.res[layer, expert] = slot
        self.own[slot] = (layer, expert)
        self.stats["fills"] += 1
        return old_layer, old_expert

    def slot(self, slot: int) -> torch.Tensor:
        """The storage bytes of one slot, uint8 [slot_stride]."""
        return self.storage[slot]

    def resize(self, capacity: int, refill=None) -> int:
        """Makes the pool `capacity` slots; returns how many residents it evicted. Shrink: the
        least recently used residents are evicted (counted as evictions), survivors keep their
        slot where it is below `capacity`, the others move into freed slots, bytes and stamps
        with them; the old storage is released. Grow: every resident stays where it is, the new
        slots are empty. `owner` and `last_used` are new objects after: whoever holds views of
        them must drop them. Fixed-address storage (`memory`): the moves are device copies in
        place, then the tail is unmapped (shrink) or mapped and zeroed (grow, mapped before the
        books change: torch.OutOfMemoryError leaves the cache as it was); `storage` stays.
        Otherwise `storage` is a new object too, and on cuda: the new storage is allocated
        beside the old and the kept slots are copied on the device; when that does not fit (the
        reason to shrink may be that memory is short) the old storage is released first and
        `refill(slots)` must copy those slots' experts from the host banks (the residency is
        already final then)."""
        total = self.num_experts_total
        if not 0 <= capacity <= total:
            raise ConfigError(f"the expert cache must hold between 0 and {total} experts "
                              f"(every expert of the model), not {capacity}")
        old = self.capacity
        if self.memory is not None and capacity > old:
            self._map(capacity)
        resident = np.flatnonzero(self.own[:, 0] >= 0)
        by_recency = resident[np.argsort(-self.stamps[resident], kind="stable")]
        keep, evict = by_recency[:capacity], by_recency[capacity:]
        for s in evict:
            self.res[self.own[s, 0], self.own[s, 1]] = -1
        stay = keep[keep < capacity]
        move = keep[keep >= capacity]
        free = np.setdiff1d(np.arange(min(old, capacity)), stay)[:len(move)]
        slots = np.concatenate([stay, free]).astype(np.int64)  # new slot of each kept one
        kept = np.concatenate([stay, move]).astype(np.int64)  # its old slot
        own = np.full((capacity, 2), -1, dtype=np.int64)
        own[slots] = self.own[kept]
        # empty slots: unique stamps below every stamp in use (and below 0, as at start)
        floor = min(0, int(self.stamps.min()) if old else 0)
        stamps = floor - 1 - np.arange(capacity, dtype=np.int64)
        stamps[slots] = self.stamps[kept]
        self.res[own[slots, 0], own[slots, 1]] = slots
        self.own, self.stamps, self.capacity = own, stamps, capacity
        if self.memory is None:
            self.max_slots = capacity  # (a new storage each time: as large as it is)
        self.owner, self.last_used = torch.from_numpy(own), torch.from_numpy(stamps)
        self.stats["evictions"] += len(evict)
        if self.memory is not None:
            self._move_in_place(capacity, old, free, move)
        elif self.storage is not None:
            self._move_storage(capacity, old, free, move, slots, refill)
        return len(evict)

    def _map(self, capacity: int) -> None:
        """A grow of fixed-address storage: slots [capacity_now, capacity) mapped and zeroed."""
        if capacity > self.max_slots:
            raise ConfigError(f"the expert cache's fixed-address storage holds at most "
                              f"{self.max_slots} slots, not {capacity}")
        try:
            self.memory.resize(capacity * self.slot_stride)
        except vmm.VmmError as e:
            self.memory.resize(self.capacity * self.slot_stride)
            raise torch.OutOfMemoryError(
                f"growing the expert cache to {capacity} slots: {e}") from e
        self.storage[self.capacity:capacity].zero_()  # (the padding routes' slot 0, as at start)

    def _move_in_place(self, capacity, old, free, move) -> None:
        """resize's bytes on fixed-address storage: each kept slot past the new end copied into
        a free slot below it (free < capacity <= move: no copy reads a slot another wrote), then
        the tail past `capacity` unmapped (after the copies: SlotMemory.resize synchronizes
        first)."""
        # slot by slot: a gather of them all would take as much memory again, at the moment
        # memory may be short (a shrink); each copy is one device-to-device memcpy
        for dst, src in zip(free.tolist(), move.tolist()):
            self.storage[dst].copy_(self.storage[src])
        if capacity < old:
            self.memory.resize(capacity * self.slot_stride)

    def _move_storage(self, capacity, old, free, move, kept_slots, refill) -> None:
        """resize's bytes: a new [capacity, stride] storage holding the kept slots' bytes."""
        device, stride = self.storage.device, self.slot_stride
        try:
            storage = torch.zeros((capacity, stride), dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError:
            if refill is None:
                raise
            self.storage = None  # release first, then take the bytes from the host banks
            torch.cuda.empty_cache()
            self.storage = torch.zeros((capacity, stride), dtype=torch.uint8, device=device)
            refill(kept_slots.tolist())
            return
        n = min(old, capacity)
        storage[:n] = self.storage[:n]  # slots that stay in place (and empty ones)
        if len(move):
            idx = torch.from_numpy(free).to(device), torch.from_numpy(move).to(device)
            storage[idx[0]] = self.storage[idx[1]]
        self.storage = storage
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the old pool back to the driver (other programs)

    def check_integrity(self) -> None:
        """Raise AssertionError unless residency and owner are mutual inverses, each expert is
        resident at most once, residents <= capacity and stamps are unique and <= clock."""
        layers, experts = np.nonzero(self.res >= 0)
        slots = self.res[layers, experts]
        assert len(slots) <= self.capacity, "more residents than slots"
        assert len(np.unique(slots)) == len(slots), "two experts share a slot"
        assert ((slots >= 0) & (slots < self.capacity)).all(), "a slot id is out of range"
        assert (self.own[slots, 0] == layers).all() and (self.own[slots, 1] == experts).all(), \
            "a resident expert's slot has another owner"
        assert int((self.own[:, 0] >= 0).sum()) == len(slots), "a slot has an owner that is not resident"
        if self.capacity:
            assert len(np.unique(self.stamps)) == self.capacity, "stamps are not unique"
            assert int(self.stamps.max()) <= self.clock, "a stamp is ahead of the clock"
