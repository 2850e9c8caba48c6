"""RouteRecorder: an ExpertRuntime proxy that records the routed expert ids of every MoE layer
at every forward, for `--trace-out` (the file format is freetoken/trace.py's). Runtimes need
nothing for it: the model calls the proxy, the proxy delegates.
"""
import torch


class RouteRecorder:
    """An ExpertRuntime proxy for --trace-out: records the expert ids [T, K] of every MoE layer
    at every forward, then delegates. finish() -> [(phase, ids [T, L, K] numpy)] since start()."""

    def __init__(self, runtime, model_config):
        self.runtime = runtime
        self.moe_layers = list(model_config.moe_layers)
        self.steps = []
        self._phase, self._layers = None, {}

    def start(self) -> None:
        self.steps, self._phase, self._layers = [], None, {}

    def begin_step(self, phase: str, num_tokens: int) -> None:
        self._flush()
        self._phase = phase
        self.runtime.begin_step(phase, num_tokens)

    def forward(self, layer, x, expert_ids, weights):
        self._layers[layer] = expert_ids.cpu()  # a host sync per layer: only when tracing
        return self.runtime.forward(layer, x, expert_ids, weights)

    @property
    def stats(self) -> dict:
        return self.runtime.stats

    def finish(self) -> list:
        """The recorded steps, the current one included."""
        self._flush()
        return self.steps

    def _flush(self) -> None:
        if self._layers:
            ids = torch.stack([self._layers[l] for l in self.moe_layers], dim=1)  # [T, L, K]
            self.steps.append((self._phase, ids.numpy()))
        self._layers = {}

    def write(self, path: str, meta: dict) -> None:
        """Writes the recorded steps as one trace file (freetoken/trace.py format)."""
        from .trace import TraceWriter
        with TraceWriter(path, meta) as writer:
            for phase, ids in self.finish():
                writer.add_step(ids, phase)
