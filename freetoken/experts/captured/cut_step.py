"""The host-planned form of a captured decode step: graph_step.py's fallback where GPU-resident
control cannot run (control.reason_off: no native CPU kernels to serve it, host banks not
pinned, more routes per token than its plan kernel takes; or a batch of more tokens than its
mailboxes hold, control.max_tokens); the GPU tests also compare the two. A layer whose
experts may miss needs the host between its router and its experts (the plan, the CPU branch,
the fills), so the captured step is cut at every MoE router:

    A_0  embedding .. layer 0 router; routing and x copied to pinned host buffers
         host: wait for A_0, plan layer 0, CPU job submitted, fill list written, then B_0
    A_1  layer 0 combine (device part + CPU partial) .. layer 1 router; copies
    ...
    A_n  last combine .. logits

B_l is a small graph of its own: the layer's fills, as a kernel reading the pinned host banks
(zero_copy.py; on cuda with Triton, else the fills are copies on the copy stream that B_l waits
for), then its device experts (gathered.py) on the slots and weights the host wrote to pinned
buffers (CPU routes get weight 0 and slot 0: the Triton kernels read nothing for them, the
torch gather path computes slot 0 and adds it times 0). Every buffer that crosses a cut is a
static per-layer buffer (LayerBuffers), so the B graphs and the buffers are shared by the
captures of every KV span (graphs.py captures one step per span).

Shape legend: T tokens, K routes per token, R = T*K routes (route order r = t*K + k), D hidden.
"""
import time

import numpy as np
import torch

from ..transfer import zero_copy
from ..plan import apply_plan, make_decode_plan, make_plan


class LayerBuffers:
    """Static buffers of one MoE layer of a captured step (see the module docstring)."""

    def __init__(self, T: int, K: int, D: int, device, dtype):
        R = T * K

        is_cuda = torch.device(device).type == "cuda"

        def pinned(*shape, dtype=torch.float32):
            return torch.zeros(shape, dtype=dtype, pin_memory=is_cuda)

        def dev(*shape, dtype=torch.float32):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.ids_h, self.w_h, self.x_h = pinned(T, K, dtype=torch.int64), pinned(R), pinned(T, D)
        self.partial_h = pinned(T, D)  # the CPU job's partial
        self.slot_h, self.wdev_h = pinned(R, dtype=torch.int64), pinned(R)  # B's routes
        self.x_d = dev(T, D, dtype=dtype)
        self.slot_d, self.wdev_d = dev(R, dtype=torch.int64), dev(R)
        # zero-copy fills (zero_copy.py): fill f copies host expert fill_src[f] (-1: none) into
        # slot fill_dst[f], inside B
        self.fill_src_h, self.fill_dst_h = pinned(R, dtype=torch.int64), pinned(R, dtype=torch.int64)
        self.fill_src_d, self.fill_dst_d = dev(R, dtype=torch.int64), dev(R, dtype=torch.int64)
        self.fill_src_np, self.fill_dst_np = self.fill_src_h.numpy(), self.fill_dst_h.numpy()
        self.fill_src_np.fill(-1)
        self.out_d, self.partial_d = dev(T, D), dev(T, D)  # device part, CPU part on the device
        self.token_of_route = np.repeat(np.arange(T, dtype=np.int32), K)  # [R]
        # numpy views of the pinned buffers the host reads and writes every step
        self.ids_np, self.w_np = self.ids_h.numpy(), self.w_h.numpy()
        self.slot_np, self.wdev_np = self.slot_h.numpy(), self.wdev_h.numpy()
        self.partial_np = self.partial_h.numpy()
        self.graph = None  # B: the layer's device experts
        self.partial_dirty = False  # partial_h holds an earlier job's sum
        self.out_dirty = False  # out_d holds an earlier step's device part
        self.fill_dirty = False  # fill_src_h lists an earlier step's fills


class CutStep:
    """The host's part of each layer of a cut step: stage(layer, ...) copies the layer's routing
    and x out to its LayerBuffers (captured in A_l), host_layer((layer, T)) plans and runs it (on
    replay, or in place in an inline step), capture_expert_graphs() captures the B graphs."""

    def __init__(self, runtime, experts):
        self.rt, self.experts = runtime, experts
        self.layers = {}  # (layer, T) -> LayerBuffers: a batched step's T tokens have their own
        self.expert_pool = None
        # host seconds per phase of host_layer, summed (the benches print them per layer);
        # submit: the part of launch that starts the CPU job; wait_cpu includes keeping the
        # books, done while the CPU job runs
        self.times = dict.fromkeys(("wait_gpu", "plan", "launch", "submit", "wait_cpu"), 0.0)
        self.times["layers"] = 0
        self.is_cuda = runtime.is_cuda
        self.event = torch.cuda.Event() if self.is_cuda else None
        # fills inside B_l by a kernel reading the pinned banks (zero_copy.py) on cuda with
        # Triton, else copies on the copy stream (fills.py)
        self.zero_copy = (zero_copy.enabled(runtime.device)
                          and all(t.is_pinned() for t in runtime.host.values()))
        self.host_words = {}  # layer -> its bank as words for zero_copy.gather
        self.storage_words = None

    def stage(self, layer: int, x, expert_ids, weights):
        """Queue the copies of the layer's x [T, D], expert_ids [T, K] and weights [T, K] into
        its static buffers (made on first use) -> (the buffers, their key for host_layer)."""
        T, K = expert_ids.shape
        key = (layer, T)
        b = self.layers.get(key)
        if b is None:
            b = self.layers[key] = LayerBuffers(T, K, x.shape[1], x.device, x.dtype)
        b.x_d.copy_(x)
        b.ids_h.copy_(expert_ids, non_blocking=True)
        b.w_h.copy_(weights.reshape(-1).float(), non_blocking=True)
        b.x_h.copy_(x.float(), non_blocking=True)
        return b, key

    @staticmethod
    def combine(b: LayerBuffers, dtype) -> torch.Tensor:
        """The layer's output: the device part plus the CPU's partial, copied in."""
        b.partial_d.copy_(b.partial_h, non_blocking=True)
        return (b.out_d + b.partial_d).to(dtype)

    def capture_expert_graphs(self) -> None:
        """B_l for every layer that has none yet, captured on the current (side) stream after
        one warm-up run (slot 0 at weight 0: out_d = 0)."""
        if self.rt.cache.capacity == 0:
            return  # no slots: every route runs on the CPU, B never runs
        for (layer, _), b in self.layers.items():
            if b.graph is None:
                b.fill_src_np.fill(-1)  # the warm-up run fills nothing
                self._expert_body(layer, b)
                g = torch.cuda.CUDAGraph()
                if self.expert_pool is None:  # one pool: the B graphs replay one at a time
                    self.expert_pool = torch.cuda.graph_pool_handle()
                g.capture_begin(pool=self.expert_pool)
                self._expert_body(layer, b)
                g.capture_end()
                b.graph = g

    def _expert_body(self, layer, b):
        b.slot_d.copy_(b.slot_h, non_blocking=True)
        b.wdev_d.copy_(b.wdev_h, non_blocking=True)
        if self.zero_copy:
            b.fill_src_d.copy_(b.fill_src_h, non_blocking=True)
            b.fill_dst_d.copy_(b.fill_dst_h, non_blocking=True)
            info = self.rt.infos[layer]
            src = self.host_words.get(layer)
            if src is None:
                src = self.host_words[layer] = zero_copy.host_words(
                    self.rt.host[layer], info.num_experts, info.slot_stride)
            if self.storage_words is None:
                self.storage_words = self.rt.cache.storage.view(torch.int32)  # [C, stride / 4]
            zero_copy.gather(src, self.storage_words, b.fill_src_d, b.fill_dst_d, info.slot_stride)
        b.out_d.copy_(self.experts.run(layer, b.x_d, b.slot_d, b.wdev_d))

    def host_layer(self, key: tuple) -> None:
        """Plan the layer from the routing A_l copied out, start the CPU job and B_l (the fills,
        then the device experts), wait for the CPU partial (A_{l+1} copies it to the device).
        With zero-copy fills the GPU path (fills over PCIe) is started first, else the CPU job.
        Only what the data paths wait for comes before them; the cache's books (apply_plan)
        and the counters are kept while they run (the next layer's plan reads the books, and
        it comes after the wait)."""
        rt, b, tm = self.rt, self.layers[key], self.times
        layer, T = key
        if rt.books_on_device:  # after steps under GPU-resident control
            rt.sync_books()
        t0 = time.perf_counter()
        if self.is_cuda:
            self.event.record()
        if b.partial_dirty:  # while the GPU runs A_l (the partial was last read a step ago)
            b.partial_np.fill(0)
            b.partial_dirty = False
        if self.is_cuda:
            self.event.synchronize()  # A_l's copies of the routing are in the pinned buffers
        t1 = time.perf_counter()
        plan = rt.plan(make_decode_plan if T == 1 else make_plan, layer, b.ids_np)
        slots = plan.route_slot.numpy()  # [R] route order, -1 = CPU
        on_cpu = slots < 0
        t2 = time.perf_counter()
        if self.zero_copy and plan.fills:
            self._start_device(layer, b, plan, slots, on_cpu)
            t_cpu = time.perf_counter()
            job = self._start_cpu(layer, b, on_cpu)
            t_sub = time.perf_counter() - t_cpu
        else:
            t_cpu = time.perf_counter()
            job = self._start_cpu(layer, b, on_cpu)
            t_sub = time.perf_counter() - t_cpu
            self._start_device(layer, b, plan, slots, on_cpu)
        t3 = time.perf_counter()
        apply_plan(rt.cache, plan)
        rt.count_routes(b.ids_np.size)
        rt._count(plan)
        if job is not None:
            job.wait()
        t4 = time.perf_counter()
        rt.filler.admit(layer, plan)  # the CPU job has ended: admissions, for later steps
        tm["wait_gpu"] += t1 - t0
        tm["plan"] += t2 - t1
        tm["launch"] += t3 - t2
        tm["submit"] += t_sub
        tm["wait_cpu"] += t4 - t3
        tm["layers"] += 1

    def _start_cpu(self, layer, b, on_cpu):
        """The CPU job of the layer's CPU routes into the pinned partial, or None."""
        if not on_cpu.any():
            return None
        b.partial_dirty = True
        return self.rt.executor.submit(layer, b.x_h, b.token_of_route[on_cpu],
                                       b.ids_np.reshape(-1)[on_cpu], b.w_np[on_cpu],
                                       out=b.partial_h)

    def _start_device(self, layer, b, plan, slots, on_cpu):
        """The fills (zero-copy: listed for B_l; else copies B_l waits for) and B_l."""
        fill_done = self.rt.filler.fill(layer, plan, fills=not self.zero_copy)
        if self.zero_copy and plan.fills:
            n = len(plan.fills)
            b.fill_src_np[:n] = [f[0] for f in plan.fills]
            b.fill_dst_np[:n] = [f[1] for f in plan.fills]
            b.fill_src_np[n:] = -1
            b.fill_dirty = True
        elif self.zero_copy and b.fill_dirty:
            b.fill_src_np.fill(-1)
            b.fill_dirty = False
        if not on_cpu.all():
            np.copyto(b.slot_np, slots)
            np.copyto(b.wdev_np, b.w_np)
            b.slot_np[on_cpu] = 0  # slot 0 is never NaN (zeroed pool), weight 0
            b.wdev_np[on_cpu] = 0
            if fill_done is not None:
                torch.cuda.current_stream(self.rt.device).wait_event(fill_done)
            if b.graph is not None:
                b.graph.replay()
            else:  # an inline step (no graph captured yet)
                self._expert_body(layer, b)
            b.out_dirty = True
        elif b.out_dirty:
            b.out_d.zero_()
            b.out_dirty = False
