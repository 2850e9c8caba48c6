"""The expert side of a captured decode step (cuda, CUDA graphs; the engine side is
freetoken/graphs.py). While graphs.py captures the model's forward, ExpertRuntime.forward hands
each MoE layer to GraphStep.forward; on replay, GraphStep.replay runs what was captured.

When the cache holds every expert nothing needs the host: the slots come from a device copy of
the residency table and the whole step is one graph. Under GPU-resident control (control.py,
the default on cuda with Triton and the native kernels) the step is one graph too, for one token
or a batch of up to control.max_tokens (device_plan.MAX_ROUTES routes): each layer is planned on
the GPU over the step's tokens and the host serves the CPU routes through mailboxes in pinned
memory. The fallback (what control.reason_off names, or a batch
larger than that) cuts the step at every MoE router for the host's plan (cut_step.py): segments
of graph with the host's part of a layer between them.

Shape legend: T tokens, K routes per token, R = T*K routes (route order r = t*K + k), D hidden.
"""
import threading

import torch

from . import control
from .cut_step import CutStep
from ..compute.gathered import GatheredExperts


class GraphStep:
    """Capture: begin(mode) -> the model's forward (ExpertRuntime.forward calls forward() here
    for every MoE layer) -> end() gives the segments [(graph, layer or None)]. Replay: replay(segments)."""

    def __init__(self, runtime):
        self.rt = runtime
        self.experts = GatheredExperts(runtime.cache.storage, runtime.infos, runtime.act)
        self.mode = None  # None | "inline" (a real step with the capture's structure) | "capture"
        self.thread = None  # the thread that began the mode (a prefill forward may run on another)
        self.T = 1  # tokens of the step begun (a batched step: B sequences' tokens)
        self.graph = self.pool = None
        self.segments = []
        self.res_d = None  # device copy of the residency table (every expert resident)
        self.cut = CutStep(runtime, self.experts)  # the host-planned layers (when no control)
        self.times = self.cut.times  # (the benches read them)
        self.why_host = control.reason_off(runtime)  # "" = GPU-resident control
        self.control = None if self.why_host else control.DeviceControl(runtime, self.experts)

    @property
    def zero_copy(self) -> bool:
        """Whether the host-planned layers fill by the zero-copy gather (cut_step.py)."""
        return self.cut.zero_copy

    @property
    def needs_host(self) -> bool:
        """Whether the step begun is cut at every MoE router for the host's plan."""
        return not self.rt.all_resident and not self._controlled

    @property
    def _controlled(self) -> bool:
        """Whether the step begun runs under GPU-resident control: where it runs, for steps of
        up to its mailboxes' tokens (a larger batch is cut for the host's plan)."""
        return self.control is not None and self.T <= self.control.max_tokens

    def describe(self) -> str:
        if self.control is not None:
            return self.control.describe()
        return "every expert resident" if self.rt.all_resident else f"host plans ({self.why_host})"

    # ---- capture --------------------------------------------------------------------------

    def begin(self, mode: str, pool=None, T: int = 1) -> None:
        """mode 'inline': the model's next forward is a real decode step with the capture's
        structure, the host's part of each layer done in place (on cuda this is the step
        before a capture: lazy inits, buffers and kernel choices happen here, not during the
        capture; on cpu it tests the whole path); 'capture': the next forward is recorded.
        T: the step's tokens (B > 1: a batched step)."""
        self.mode, self.pool, self.segments, self.T = mode, pool, [], T
        self.thread = threading.get_ident()
        if self._controlled:
            self.control.begin(mode, T)
        if self.rt.all_resident and self.res_d is None:
            self.res_d = self.rt.cache.residency.to(self.rt.device)  # [L, E]
        if mode == "capture":
            self._open()

    def end(self) -> list:
        """Ends the forward begun by begin(); 'capture' returns its segments."""
        segments = []
        if self._controlled:
            self.control.end()
        if self.mode == "capture":
            self._close(None)
            segments = self.segments
        elif self.mode == "inline" and self.rt.all_resident:
            self.rt.count_resident_step(self.T)
        self.mode, self.segments = None, []
        if segments:
            self.cut.capture_expert_graphs()
        return segments

    def abort(self) -> None:
        """After an error mid-capture: end the open capture, drop everything."""
        if self.graph is not None:
            try:
                self.graph.capture_end()
            except RuntimeError:
                pass
        if self._controlled:
            self.control.mode, self.control.seen = None, []
        self.graph, self.mode, self.segments = None, None, []

    def forward(self, layer: int, x, expert_ids, weights) -> torch.Tensor:
        """ExpertRuntime.forward while capturing: x [T, D], expert_ids [T, K], weights [T, K]."""
        if self._controlled:
            return self.control.forward(layer, x, expert_ids, weights)
        if not self.needs_host:
            slots = self.res_d[layer].index_select(0, expert_ids.reshape(-1))  # [R]
            return self.experts.run(layer, x, slots, weights.reshape(-1).float()).to(x.dtype)
        b, key = self.cut.stage(layer, x, expert_ids, weights)
        if self.mode == "capture":  # cut: the host plans this layer on replay
            self._close(key)
            self._open()
        else:
            self.cut.host_layer(key)
        return self.cut.combine(b, x.dtype)

    def _open(self):
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.pool)

    def _close(self, layer):
        self.graph.capture_end()
        self.segments.append((self.graph, layer))
        self.graph = None

    # ---- replay ---------------------------------------------------------------------------

    def replay(self, segments: list, T: int = 1) -> None:
        """One decode step of T tokens (the T it was captured with): each segment, then the
        host's part of the layer it ends at."""
        self.T = T
        if self._controlled:
            (graph, _), = segments
            self.control.replay(graph, T)
            return
        for graph, key in segments:
            graph.replay()
            if key is not None:
                self.cut.host_layer(key)
        if not self.needs_host:
            self.rt.count_resident_step(T)
