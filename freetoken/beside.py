"""The decode steps that run beside a prefill forward (scheduler.Scheduler._beside picks one), so
a long prompt does not freeze the sequences already generating: their misses run on the CPU
while the prefill's expert layers stream over the link (runtime.beside_prefill). Tuning
decode_beside "interleave": Interleaved, a step between the forward's MoE layers on the
scheduler's own thread; "thread": Thread, steps back to back on a thread (and CUDA stream) of
their own while the forward streams every layer. Both only call back into the scheduler
(_decode) and the engine; they own no request."""
import contextlib
import threading

import torch


class Interleaved:
    """The between-layers hook of a prefill forward (MoETransformer.forward's between): after
    every `every`-th MoE block, one decode step of the requests that were generating when the
    chunk began (those still running), their misses on the CPU while the prefill's layers stream over the
    link (runtime.beside_prefill). `steps`: decode steps it ran."""

    def __init__(self, scheduler, decoding: list, every: int):
        self.scheduler, self.decoding, self.every = scheduler, decoding, every
        self.steps = self.layers = 0
        self.moe = frozenset(scheduler.engine.model_config.moe_layers)

    def __call__(self, layer: int) -> None:
        if layer not in self.moe:
            return
        self.layers += 1
        if self.layers % self.every:
            return
        live = [r for r in self.decoding if not r.finished]
        if not live:
            return
        beside = getattr(self.scheduler.engine.experts, "beside_prefill", None)
        with beside() if beside is not None else contextlib.nullcontext():
            self.scheduler._decode(live)
        self.steps += 1


class Thread:
    """While the scheduler's thread runs one prefill forward that
    streams every MoE layer (runtime.prefill_beside_thread), the requests that were generating
    when the chunk began (those still running) run their decode steps back to back on a thread
    of their own, on cuda on a CUDA stream of their own, their misses on the CPU
    (runtime.beside_prefill, as Interleaved's): the steps overlap the forward's layers instead of
    waiting for them. A context manager around the forward: entering starts the thread,
    leaving stops it after its current step, joins it, and raises what it raised. `steps`:
    decode steps it ran (0: the scheduler runs one after the chunk)."""

    def __init__(self, scheduler, decoding: list):
        self.scheduler, self.decoding = scheduler, decoding
        self.steps = 0
        self.error = None
        self.stop = threading.Event()
        self.stream = None
        self.num_threads = torch.get_num_threads()  # (a new thread starts at torch's default)
        self.thread = threading.Thread(target=self._run, name="ft-decode-beside", daemon=True)

    def __enter__(self):
        eng = self.scheduler.engine
        if eng.device.type == "cuda":
            if self.scheduler.decode_stream is None:
                # high priority: the prefill's large kernels would otherwise hold the SMs while
                # a decode step's small ones wait (H200, 16K prefill: the decode kept 27-41% of
                # its rate on a default-priority stream; this to be measured against it)
                self.scheduler.decode_stream = torch.cuda.Stream(eng.device, priority=-1)
            self.stream = self.scheduler.decode_stream
            # the tokens sampled so far (and every other write of this stream) before its steps
            self.stream.wait_stream(torch.cuda.current_stream(eng.device))
        self.thread.start()
        return self

    def __exit__(self, kind, error, tb):
        self.stop.set()
        self.thread.join()
        if self.stream is not None:  # what the steps wrote before anything after the forward
            torch.cuda.current_stream(self.scheduler.engine.device).wait_stream(self.stream)
        if self.error is not None:
            if error is not None:  # the forward's error goes on; the thread's goes with it
                error.add_note(f"the decode thread beside the prefill forward failed too: "
                               f"{self.error!r}")
                return False
            raise self.error
        return False

    def _run(self) -> None:
        eng = self.scheduler.engine
        rt, graphs = eng.experts, eng.graphs
        try:
            torch.set_num_threads(self.num_threads)
            on_stream = (torch.cuda.stream(self.stream) if self.stream is not None
                         else contextlib.nullcontext())
            with torch.no_grad(), on_stream:  # (grad mode and the stream are per thread)
                while not self.stop.is_set():
                    live = [r for r in self.decoding if not r.finished]
                    if not live or (graphs is not None and not graphs.ready([r.kv for r in live])):
                        return  # (a capture runs on the scheduler's thread, after the chunk)
                    with rt.beside_prefill():
                        self.scheduler._decode(live)
                    self.steps += 1
        except BaseException as e:  # raised on the scheduler's thread (__exit__)
            self.error = e
            abandon = getattr(getattr(rt, "executor", None), "abandon", None)
            if abandon is not None:
                abandon()  # a CPU job it left holding the pool: the forward's jobs go on
