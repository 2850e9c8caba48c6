"""SlotFiller: copies planned fills (and fill-behind copies) from the host banks into expert
cache slots. cuda: async copies from pinned banks on a copy stream, with the events the compute
waits on; cpu tier: numpy copies, done on return. Owns no decisions (the plan makes them).
"""
import torch


class SlotFiller:
    def __init__(self, cache, infos: dict, banks: dict, host: dict, device):
        self.cache, self.infos, self.banks, self.host = cache, infos, banks, host
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self.fill_done = torch.cuda.Event() if self.is_cuda else None
        self.compute_done = torch.cuda.Event() if self.is_cuda else None  # fills wait for it
        self.behind_done = torch.cuda.Event() if self.is_cuda else None  # after fill-behind copies
        self.pending_behind = False  # fill-behind copies queued since the compute last waited
        self.host_slot_views, self.slot_views = {}, {}  # see _host_slots, _slot_view

    def fill(self, layer, plan, fills: bool = True):
        """Copy the plan's fills (unless `fills` is False: a captured step's zero-copy kernel
        does them, zero_copy.py), then its fill-behind ones, from the host bank into their
        slots. Returns a CUDA event to wait on before the device uses the fills (None when
        there are none, and on the cpu tier, where the copies are done). Earlier fill-behind
        copies may still be in flight, and this step's hits may be their slots: the compute
        stream is made to wait for them here (they were queued a layer ago or more; the wait
        is normally already satisfied)."""
        behind = plan.behind or ()
        planned = plan.fills if fills else ()
        if self.pending_behind:
            torch.cuda.current_stream(self.device).wait_event(self.behind_done)
            self.pending_behind = False
        if not planned and not behind:
            return None
        stride = self.infos[layer].slot_stride
        if not self.is_cuda:  # numpy memcpy: one thread, no OpenMP team for a few hundred KB
            slots, bank = self.cache.storage.numpy(), self.banks[layer].data
            for e, s, _, _ in list(planned) + list(behind):
                slots[s, :stride] = bank[e * stride:(e + 1) * stride]
            return None
        # the slots may still be read by kernels queued on the compute stream (one event,
        # re-recorded: wait_stream would make a new one per call)
        self.compute_done.record(torch.cuda.current_stream(self.device))
        self.copy_stream.wait_event(self.compute_done)
        src = self._host_slots(layer)
        done = None
        with torch.cuda.stream(self.copy_stream):
            for e, s, _, _ in planned:
                self._slot_view(s, stride).copy_(src[e], non_blocking=True)
            if planned:  # one event, re-recorded: waits on it are enqueued right away
                self.fill_done.record(self.copy_stream)
                done = self.fill_done
            for e, s, _, _ in behind:
                self._slot_view(s, stride).copy_(src[e], non_blocking=True)
            if behind:
                self.behind_done.record(self.copy_stream)
                self.pending_behind = True
        return done

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
