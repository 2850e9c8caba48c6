"""SlotFiller: copies planned fills (and admissions, fill-behind) from the host banks into expert
cache slots. cuda: async copies from pinned banks on a copy stream, with the events the compute
waits on (issued through the driver API, cuda_copy.py, where libcuda loads); cpu tier: numpy copies, done on return. Owns no decisions (the plan makes them).
"""
import torch

from . import cuda_copy


class SlotFiller:
    def __init__(self, cache, infos: dict, banks: dict, host: dict, device):
        self.cache, self.infos, self.banks, self.host = cache, infos, banks, host
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        # the copies: through the driver API where libcuda loads (host-cheap), else torch's
        self.driver = self.is_cuda and cuda_copy.available()
        event = cuda_copy.Event if self.driver else torch.cuda.Event
        self.fill_done = event() if self.is_cuda else None
        self.compute_done = event() if self.is_cuda else None  # fills wait for it
        self.behind_done = event() if self.is_cuda else None  # after fill-behind copies
        self.pending_behind = False  # fill-behind copies queued since the compute last waited
        self.host_slot_views, self.slot_views = {}, {}  # see _host_slots, _slot_view

    def fill(self, layer, plan, fills: bool = True):
        """Copy the plan's fills (unless `fills` is False: a captured step's zero-copy kernel
        does them, zero_copy.py) from the host bank into their slots. Returns a CUDA event to
        wait on before the device uses them (None when there are none, and on the cpu tier,
        where the copies are done). Earlier admission copies (admit) may still be in flight,
        and this step's hits may be their slots: the compute stream is made to wait for them
        here (they were queued a layer ago; the wait is normally already satisfied)."""
        if self.pending_behind:
            torch.cuda.current_stream(self.device).wait_event(self.behind_done)
            self.pending_behind = False
        if not fills or not plan.fills:
            return None
        if self._copy(layer, plan.fills, self.fill_done):
            return self.fill_done
        return None

    def admit(self, layer, plan) -> None:
        """Copy the plan's admissions (plan.behind: experts the step ran on the CPU, kept for
        later steps) into their slots. Called once the step's CPU job has ended, so the copies
        run while the next layer's attention does and read no host memory beside the job."""
        if plan.behind and self._copy(layer, plan.behind, self.behind_done):
            self.pending_behind = True

    def copy_now(self, layer, moves) -> None:
        """Copy [(expert, slot)] of `layer` from the host bank; returns when they are done."""
        if self._copy(layer, moves, self.fill_done):
            torch.cuda.synchronize(self.device)

    def _copy(self, layer, moves, done) -> bool:
        """Queue copies of [(expert, slot, ...)] and record `done` after them (cuda: True);
        the cpu tier copies now (False)."""
        stride = self.infos[layer].slot_stride
        if not self.is_cuda:  # numpy memcpy: one thread, no OpenMP team for a few hundred KB
            slots, bank = self.cache.storage.numpy(), self.banks[layer].data
            for e, s, *_ in moves:
                slots[s, :stride] = bank[e * stride:(e + 1) * stride]
            return False
        # the slots may still be read by kernels queued on the compute stream (one event,
        # re-recorded: wait_stream would make a new one per call)
        compute = torch.cuda.current_stream(self.device)
        if self.driver:  # the driver API: about a µs of host time per call (cuda_copy.py)
            cs, copy = self.copy_stream.cuda_stream, cuda_copy.copy_htod
            self.compute_done.record(compute)
            self.compute_done.wait(cs)
            src = self.host[layer].data_ptr()
            dst, row = self.cache.storage.data_ptr(), self.cache.storage.stride(0)
            for e, s, *_ in moves:
                copy(dst + s * row, src + e * stride, stride, cs)
            done.record(cs)
            return True
        self.compute_done.record(compute)
        self.copy_stream.wait_event(self.compute_done)
        src = self._host_slots(layer)
        with torch.cuda.stream(self.copy_stream):
            for e, s, *_ in moves:
                self._slot_view(s, stride).copy_(src[e], non_blocking=True)
            done.record(self.copy_stream)  # one event, re-recorded: waits on it are enqueued now
        return True

    def _host_slots(self, layer):
        """[E] uint8 views of the layer's pinned host slots, made once (a decode step issues a
        few fills per layer: per-fill slicing cost more host time than the copy's issue)."""
        views = self.host_slot_views.get(layer)
        if views is None:
            info = self.infos[layer]
            bank = self.host[layer][:info.num_experts * info.slot_stride]
            views = self.host_slot_views[layer] = bank.view(info.num_experts, info.slot_stride).unbind(0)
        return views

    def _slot_view(self, slot, stride):
        v = self.slot_views.get((slot, stride))
        if v is None:
            v = self.slot_views[slot, stride] = self.cache.storage[slot, :stride]
        return v
