"""Engine.warm_up: the kernels' compiles at load instead of at the first requests that need them
(`freetoken serve` runs it before it listens).

Triton compiles a kernel once per variant: its block sizes follow the batch size (the plan
kernel's routes) and the KV span (the decode attention's splits), and integer arguments that are
1 or multiples of 16 get their own. Unwarmed, a 4-client agent session's first steps waited
2.4-7.6 s for them and its worst first-token time was 17.9 s (docs/MEASUREMENTS.md#warm-up).
On cuda it runs `parallel` short requests together (prompts of odd and even lengths in one packed
prefill, then decode steps at every batch size down to 1, each size's graphs captured at the
shortest span) and the decode attention at every span (graphs.DecodeGraphs.warm_spans); the
prefix cache keeps none of it. The CPU kernels are compiled ahead: nothing to do there.
"""
import time

import torch

from .sampling import SamplingParams
from .stats import GenerationStats


def warm_up(engine) -> float:
    """Warms `engine` (an Engine) on cuda; returns the seconds it took (0.0 elsewhere)."""
    if engine.device.type != "cuda":
        return 0.0
    t0 = time.perf_counter()
    warm_requests(engine)
    if engine.graphs is not None:
        engine.graphs.warm_spans()
    torch.cuda.synchronize(engine.device)
    engine.last_stats = GenerationStats(load_s=engine.load_s)
    return time.perf_counter() - t0


def warm_requests(engine) -> None:
    """`parallel` short requests stepped to their ends, their pages freed: request i generates
    2 + i tokens, so the decode steps run at batch parallel, parallel - 1, ..., 1; each prompt
    (17 + 16 i tokens) and its tokens fit the context."""
    room = engine.max_seq_tokens
    if room < 2:  # no prompt and token fit: nothing to decode
        return
    vocab = engine.model_config.vocab_size
    reqs = []
    for i in range(engine.config.parallel):
        new = min(2 + i, room - 1)
        length = min(17 + 16 * i, room - new)
        ids = [(7 + 13 * j + i) % vocab for j in range(length)]
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        reqs.append(engine.submit(ids, params, prefix_cache=False))
    try:
        while not all(r.finished for r in reqs):
            engine.step()
    finally:
        for r in reqs:
            engine.scheduler.cancel(r)
    radix = engine.kv_manager.radix
    if radix is not None:  # their finished pages went into the tree: out again
        radix.evict(radix.num_evictable_pages)
