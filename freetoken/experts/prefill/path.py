"""PrefillPath: the prefill half of ExpertRuntime (runtime.py owns one as `runtime.prefill`).
Per MoE layer of a prefill forward it either runs every route from the whole expert layer,
streamed into a device layer buffer (stream.py's LayerStreamer), or hands the layer back to the
runtime's slot path (plan -> fills + CPU experts, as decode does), as PrefillChoice decides
(prefill/choice.py). Owns the streamer and the choice; reads the cache's residency, never
changes it (a streamed layer does not warm the cache); counts into the runtime's stats dict.

    begin(phase, T)   once per forward: `streaming` and `mode` (stream | slot | auto, None when
                      the forward cannot stream); the first layers' copies start
    run(layer, ...)   per MoE layer while `streaming`: True when the layer streamed (its routes
                      are added into out), False with nothing done (the runtime plans it)

Shape legend: T tokens, K routes per token, R = T*K routes, E experts of the layer, D hidden.
"""
import math
import os
import threading

import numpy as np
import torch

from ..bank import pool_bytes, pool_views
from ..compute import grouped_experts
from ..ffn import ExpertWeights, group_routes_on_device, run_expert_runs, run_stacked_layer
from .choice import DEFAULT_CPU_GFLOPS_PER_THREAD, PrefillChoice
from .stream import LayerStreamer


class PrefillPath:
    """Prefill streaming for one ExpertRuntime. It reads the runtime's parts once (infos, cache,
    executor, split, ...) and keeps no reference to the runtime itself. Tuning (config.Tuning):
    prefill_stream (default on, off on the cpu device with no cache), prefill_stream_min_tokens
    (default ceil(E / K)), prefill_buffers, and the choice's fields (_make_choice)."""

    def __init__(self, runtime, engine_config):
        rt, tuning = runtime, engine_config.tuning
        self.infos, self.cache, self.executor = rt.infos, rt.cache, rt.executor
        self.device, self.dtype, self.is_cuda, self.act = rt.device, rt.dtype, rt.is_cuda, rt.act
        self.quant = rt.quant  # {layer: compute.quant_blocks.QuantSpec or None}
        self.tier_on_pool, self.all_resident = rt.tier_on_pool, rt.all_resident
        self.stats = rt._stats  # the runtime's counters (the host's books: synced before run)
        self.stats_lock = rt.stats_lock  # (for the counters a decode thread adds to too)
        E = max((i.num_experts for i in self.infos.values()), default=1)
        self.min_tokens = (tuning.prefill_stream_min_tokens
                           if tuning.prefill_stream_min_tokens is not None
                           else max(2, math.ceil(E / rt.top_k)))
        # no device tier on the cpu device: everything, prefill too, runs on the CPU executor
        plain_cpu = not self.is_cuda and self.cache.capacity == 0
        self.enabled = (tuning.prefill_stream if tuning.prefill_stream is not None
                        else not plain_cpu)
        self.streamer = (LayerStreamer(rt.banks, rt.host, self.device, tuning.prefill_buffers)
                         if self.enabled else None)
        self.choice = self._make_choice(rt.split, rt.top_k, engine_config, rt.rates)
        # this thread's forward (streaming, mode, copy_ahead below): a decode thread may run
        # beside a prefill forward (runtime.prefill_beside_thread)
        self._this = _ThisForward()

    # whether this forward may stream (begin); its mode: stream | slot | auto (begin); whether the
    # streamed layer's release issues the copy N layers on
    streaming = property(lambda self: self._this.streaming,
                         lambda self, v: setattr(self._this, "streaming", v))
    mode = property(lambda self: self._this.mode, lambda self, v: setattr(self._this, "mode", v))
    copy_ahead = property(lambda self: self._this.copy_ahead,
                          lambda self, v: setattr(self._this, "copy_ahead", v))

    def begin(self, phase: str, num_tokens: int, only_stream: bool = False) -> None:
        """Once per model forward (ExpertRuntime.begin_step). A prefill forward that may stream
        goes through run() layer by layer, which streams the layer or hands it back to the slot
        path (prefill/choice.py). only_stream: every layer streams (where the forward may stream
        at all: runtime.prefill_beside_thread)."""
        self.streaming = phase == "prefill" and self.streamer is not None and not self.all_resident
        self.mode = (self.choice.forward_mode(num_tokens, self.infos, self.cache.capacity)
                     if self.streaming else None)
        if only_stream and self.mode is not None and self.mode != "slot":
            self.mode = "stream"
        if self.choice.log is not None:
            self.choice.log = []  # the bench's per-layer decisions, this forward's
        if self.mode in ("stream", "auto"):
            self.streamer.begin()  # the first prefill_buffers layers start crossing now

    def run(self, layer, x, expert_ids, w_flat, out) -> bool:
        """Prefill, one MoE layer (x [T, D], expert_ids [T, K], w_flat [R] fp32, out fp32 [T, D]):
        every route from the streamed layer buffer (stream.py), or, when the layer takes the
        slot path (_stream_layer), False with nothing done: the runtime then plans it. On the
        device the routes are grouped before the buffer is acquired: the host's one sync (the
        experts' route counts, which the choice reads too) waits for the router, not for the
        layer's copy, so the host prepares the launch while the copy finishes. release() starts
        the copy of a later layer."""
        info = self.infos[layer]
        E, T, K = info.num_experts, *expert_ids.shape
        if self.mode == "slot" and self.choice.log is None:
            self.stats["prefill_layers_slot"] += 1  # the whole forward: no counts needed
            return False
        # [2, R] token, route on the device (not for the cpu tier's job); counts [E]: the sync
        idx, counts, counts_d = group_routes_on_device(expert_ids, E, order=not self.tier_on_pool)
        if not self._stream_layer(layer, info, counts):
            return False
        if self.tier_on_pool:  # cpu tier: one kernel job over the layer buffer read as a bank
            buf = self.streamer.acquire(layer)  # uint8 [E * slot_stride]
            token_ids = np.repeat(np.arange(T, dtype=np.int32), K)  # [R] route order
            self.executor.submit_slots(
                layer, x.to(torch.float32), buf.view(E, info.slot_stride),
                token_ids, expert_ids.reshape(-1).numpy(), w_flat.numpy(), out).wait()
        else:
            buf = self.streamer.acquire(layer)  # uint8 [E * slot_stride] on the device
            quant = self.quant[layer]  # quantized: the projections' bytes (bank.pool_bytes)
            views = (pool_bytes if quant is not None else pool_views)(buf.view(E, info.slot_stride), info)
            stacks = ExpertWeights.of(views)
            if grouped_experts.chosen_stacks(x, stacks, quant):
                # the grouped kernels, their tables built on the device: a host-to-device copy
                # would queue behind the layer copies (docs/MEASUREMENTS.md#grouped-prefill-experts)
                run_stacked_layer(x, idx, w_flat, out, stacks, counts, counts_d, self.act, quant)
            else:
                runs = [(ExpertWeights.of(views, e), n) for e, n in enumerate(counts.tolist()) if n]
                run_expert_runs(x, idx, w_flat, out, runs, self.dtype, act=self.act, quant=quant)
        self.streamer.release(layer, ahead=self.copy_ahead)
        s = self.stats
        with self.stats_lock:
            s["prefill_layers_streamed"] += 1
            s["bytes_streamed"] += E * info.slot_stride
            s["device_routes"] += T * K
        return True

    def _stream_layer(self, layer, info, counts) -> bool:
        """Whether this prefill layer streams (prefill/choice.py), from its route counts [E]
        and the cache's residency. A layer that takes the slot path skips its buffer: a copy
        of it already issued is sunk (stream.py: on cuda it lands, cheaper than breaking the
        copy stream's order; the cpu tier withdraws one not started) and the copy of the
        layer N places later is not issued ahead (predicted: slot path too)."""
        mode = self.mode
        self.copy_ahead = True
        if mode == "stream" and self.choice.log is None:
            return True
        left = self.streamer.copy_left_us(layer) if mode != "slot" else None
        resident = self.cache.res[layer, :info.num_experts] >= 0  # [E]
        cost = self.choice.choose(layer, info, counts, resident, self.cache.capacity, left, mode)
        if cost.streamed:
            # the copy of the layer N places on is issued when this one releases its buffer
            # only if that layer is predicted to stream with its whole copy still to pay (its
            # experts and misses taken as this layer's): a copy issued ahead is sunk if the
            # layer then takes the slot path, and it makes streaming look cheaper than it was
            self.copy_ahead = mode != "auto" or cost.copy_us <= cost.slot_us
            return True
        if mode != "slot" and self.streamer.skip(layer):
            self.stats["prefill_copies_sunk"] += 1
        self.stats["prefill_layers_slot"] += 1
        return False

    def _make_choice(self, split, top_k, engine_config, rates) -> PrefillChoice:
        """The per-layer prefill choice from the tuning's prefill_choice (default auto on cuda,
        stream on the cpu device), prefill_stream_gbps (B_P; default the profile's whole-layer
        copies, else the split's slot copy alone) and prefill_cpu_gflops (default the profile's
        F, else DEFAULT_CPU_GFLOPS_PER_THREAD x threads)."""
        threads = (getattr(getattr(self.executor, "pool", None), "num_threads", None)
                   or engine_config.cpu_threads or os.cpu_count() or 1)
        tuning = engine_config.tuning
        bp = _first(tuning.prefill_stream_gbps, rates.stream_gbps, split.bw.P_alone)
        flops = _first(tuning.prefill_cpu_gflops, rates.cpu_gflops,
                       DEFAULT_CPU_GFLOPS_PER_THREAD * threads)
        mode = tuning.prefill_choice or ("auto" if self.is_cuda else "stream")
        choice = PrefillChoice(mode, split, bp, flops, top_k, self.min_tokens,
                               with_flops=self.is_cuda)
        if self.streamer is not None:
            self.streamer.gbps = choice.stream_gbps  # its model clock (copy_left_us)
        return choice

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()


class _ThisForward(threading.local):
    def __init__(self):
        self.streaming, self.mode, self.copy_ahead = False, None, True


def _first(*values):
    """The first of values that is not None."""
    return next(v for v in values if v is not None)
