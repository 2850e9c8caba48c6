"""GET /metrics after real requests on the bundled model (cpu, half the experts cached, hybrid, so
that hits, misses, fills and CPU experts all happen): every series issue 33 lists is there, the
request counts by status, one TTFT and one time-per-output-token observation per generation,
idle queue gauges, the prefix cache's hit tokens and the expert counters equal to the engine's
own counts of the same generations."""
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from freetoken.api import default_model_path
from freetoken.config import EngineConfig
from freetoken.engine import Engine
from freetoken.server.metrics import EXPERT_COUNTERS
from serve_support import http, live_server
from test_server_cache import PROMPT as CACHED_PROMPT

PROMPT = [{"role": "user", "content": CACHED_PROMPT}]  # (whole KV pages: the repeat hits them)


@pytest.fixture(scope="module")
def served():
    engine = Engine(default_model_path(), EngineConfig(device="cpu", ctx_size=256, policy="hybrid",
                                                       expert_cache_frac=0.5))
    with live_server(engine, name="default") as (url, _):
        yield engine, url
    engine.close()


def scrape(url) -> dict:
    """{(sample name, labels as sorted tuple): value} of /metrics."""
    status, text = http("GET", url + "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_after_requests(served):
    engine, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    experts = dict.fromkeys(EXPERT_COUNTERS, 0)
    cached = 0
    for stream in (False, True):  # the same prompt twice: the second reuses the first's KV
        options = dict(model="default", messages=PROMPT, temperature=0, max_tokens=6)
        if stream:
            chunks = list(client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **options))
            cached += chunks[-1].usage.prompt_tokens_details.cached_tokens
        else:
            cached += client.chat.completions.create(**options).usage.prompt_tokens_details \
                .cached_tokens
        for name in experts:  # (the worker counts a job before it answers it)
            experts[name] += engine.last_stats.experts.get(name, 0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="default", messages=PROMPT, max_tokens=-1)

    m = scrape(url)
    endpoint = (("endpoint", "/v1/chat/completions"),)
    assert m[("freetoken_requests_total", endpoint + (("status", "200"),))] == 2
    assert m[("freetoken_requests_total", endpoint + (("status", "400"),))] == 1
    for histogram in ("freetoken_time_to_first_token_seconds",
                      "freetoken_time_per_output_token_seconds"):
        assert m[(histogram + "_count", ())] == 2
        assert m[(histogram + "_sum", ())] > 0
        assert m[(histogram + "_bucket", (("le", "+Inf"),))] == 2
    assert m[("freetoken_queue_depth", ())] == 0 and m[("freetoken_running_sequences", ())] == 0
    assert cached > 0 and m[("freetoken_prefix_cache_hit_tokens_total", ())] == cached
    assert m[("freetoken_generated_tokens_total", ())] == 12
    for name, value in experts.items():
        assert m[(f"freetoken_expert_{name}_total", ())] == value, name
    for name in ("hits", "misses", "fills", "bytes_filled", "cpu_experts"):
        assert experts[name] > 0, name  # (this configuration exercises every path)
    pool = engine.kv_manager.pool  # idle: every page free or kept by the prefix cache
    kept = engine.kv_manager.num_evictable_pages
    assert kept > 0 and m[("freetoken_kv_pages", (("state", "evictable"),))] == kept
    assert m[("freetoken_kv_pages", (("state", "free"),))] == pool.num_free == pool.num_pages - kept
    assert m[("freetoken_kv_pages", (("state", "in_use"),))] == 0
    assert m[("freetoken_kept_states", ())] == m[("freetoken_kept_state_bytes", ())] == 0
