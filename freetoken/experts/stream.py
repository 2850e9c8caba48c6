"""LayerStreamer: prefill's expert-layer streaming. Whole expert layers are copied from the
host banks into two device layer buffers, double-buffered: while layer l computes from one
buffer, the next MoE layer is copied into the other. cuda: a copy stream and events; cpu tier:
a background copy thread. Knows nothing of routes or of the expert cache.

Buffer states (per buffer b):
  holder[b]  the layer whose bytes are (or are being) copied into b, or None
  ready[b]   cuda Event / Future that completes when that copy is done
  free[b]    cuda Event recorded after the last compute that read b (the next copy waits on it)
"""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch


class LayerStreamer:
    def __init__(self, banks: dict, host: dict, device):
        self.order = sorted(banks)
        self.next_layer = dict(zip(self.order, self.order[1:]))
        self.infos = {layer: b.info for layer, b in banks.items()}
        self.host = host  # {layer: uint8 host tensor}, pinned on cuda
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.nbytes = max((i.num_experts * i.slot_stride for i in self.infos.values()), default=0)
        self.buffers = None  # two uint8 [nbytes] tensors, allocated on first use
        self.holder, self.ready, self.free = [None, None], [None, None], [None, None]
        self.current = None  # buffer index the compute is using
        self.copy_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self.pool = None if self.is_cuda else ThreadPoolExecutor(1, thread_name_prefix="ft-stream")

    def prefetch(self, layer: int) -> None:
        """Start copying `layer` into the buffer the compute is not using (no-op if held)."""
        if layer in self.holder:
            return
        if self.buffers is None:
            self.buffers = [torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
                            for _ in range(2)]
        b = 0 if self.current is None else 1 - self.current
        n = self.infos[layer].num_experts * self.infos[layer].slot_stride
        dst, src = self.buffers[b][:n], self.host[layer]
        self.holder[b] = layer
        if self.is_cuda:
            with torch.cuda.stream(self.copy_stream):
                if self.free[b] is not None:
                    self.copy_stream.wait_event(self.free[b])
                dst.copy_(src, non_blocking=True)
                self.ready[b] = torch.cuda.Event()
                self.ready[b].record(self.copy_stream)
        else:  # one worker: copies into the same buffer run in submission order; numpy's
            # memcpy releases the GIL and starts no OpenMP team on the compute's cores
            self.ready[b] = self.pool.submit(np.copyto, dst.numpy(), src.numpy())

    def acquire(self, layer: int) -> torch.Tensor:
        """The layer's bytes, uint8 [E * slot_stride] on the device, ready for use by the
        current stream; starts copying the next MoE layer into the other buffer."""
        self.prefetch(layer)
        b = self.holder.index(layer)
        if self.is_cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[b])
        else:
            self.ready[b].result()
        self.current = b
        nxt = self.next_layer.get(layer)
        if nxt is not None:
            self.prefetch(nxt)
        info = self.infos[layer]
        return self.buffers[b][:info.num_experts * info.slot_stride]

    def release(self, layer: int) -> None:
        """The compute has queued all its reads of `layer`'s buffer."""
        b = self.holder.index(layer)
        if self.is_cuda:
            self.free[b] = torch.cuda.Event()
            self.free[b].record(torch.cuda.current_stream(self.device))
        self.current = None

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True)
