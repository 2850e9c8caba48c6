"""Engine.warm_up: the kernels' compiles before the first request (`freetoken serve` runs it
before it listens). What it runs is checked on the CPU (its requests, steps and freed pages);
on cuda, the captures and the spans it warms, and that a warmed engine's tokens are unchanged."""
import logging

import pytest
import torch

from freetoken.api import default_model_path
from freetoken.config import EngineConfig
from freetoken.engine import Engine
from freetoken.sampling import SamplingParams
from freetoken.warm_up import warm_requests


def test_warm_up_is_a_no_op_on_the_cpu():
    with Engine(default_model_path(), EngineConfig(device="cpu")) as e:
        assert e.warm_up() == 0.0 and e.warm_s == 0.0


def test_warm_requests_decode_at_every_batch_size_and_leave_nothing_cached(caplog):
    """parallel=3: one packed prefill of the three prompts, then decode steps at B = 3, 2, 1;
    afterwards every page is free and the prefix tree is empty."""
    with Engine(default_model_path(), EngineConfig(device="cpu", parallel=3)) as e:
        with caplog.at_level(logging.DEBUG, logger="freetoken.scheduler"):
            warm_requests(e)
        lines = [r.getMessage().split(" | ", 1)[1] for r in caplog.records]
        assert lines[0].startswith("admitted [1, 2, 3] | prefill #1: 17 (last), #2: 33 (last), "
                                   "#3: 49 (last)"), lines[0]
        batches = [line.split(" | ")[2].split(" x ")[0] for line in lines[1:]]
        assert batches == ["decode B=3", "decode B=2", "decode B=1"], lines
        assert not e.scheduler.running and not e.scheduler.waiting
        e.kv_manager.check_idle()
        assert e.kv_manager.radix.num_pages == 0
        assert e.kv_manager.pool.num_free == e.kv_manager.pool.num_pages


@pytest.mark.parametrize("ctx", [1, 2, 3, 16])
def test_warm_requests_fit_a_short_context(ctx):
    """Each warm-up prompt is cut so that it and its tokens fit; a 1-token context runs none."""
    with Engine(default_model_path(), EngineConfig(device="cpu", ctx_size=ctx, parallel=2)) as e:
        warm_requests(e)
        e.kv_manager.check_idle()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warm_up_on_cuda_captures_every_batch_size_and_keeps_tokens():
    from freetoken.graphs import MIN_SPAN
    prompt = list(range(40, 90))
    params = SamplingParams(temperature=0, max_tokens=12)
    config = EngineConfig(device="cuda", parallel=3, ctx_size=4 * MIN_SPAN,
                          expert_cache_frac=0.25)
    with Engine(default_model_path(), config) as cold:
        want = list(cold.generate(prompt, params))
    with Engine(default_model_path(), config) as e:
        assert e.warm_up() > 0 and e.warm_s > 0
        assert {(b, MIN_SPAN) for b in (1, 2, 3)} <= set(e.graphs.captured)
        assert e.graphs.warm_spans() >= 1  # the spans 256..1024 take one variant or more
        assert e.kv_manager.radix.num_pages == 0
        assert list(e.generate(prompt, params)) == want
        assert e.last_stats.cached_tokens == 0
