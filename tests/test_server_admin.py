"""POST /admin/expert-cache on the bundled model (cpu device tier, half the experts cached): behind
the API key (401), a bad value or the engine's refusal is a 400 naming it, a good one resizes at
the engine's next safe point and answers the new plan; /metrics follows (size, slots, resizes by
trigger), completions keep their greedy text across resizes made while they run, and an idle
server's memory watch still shrinks and grows the cache (its probe replaced)."""
import asyncio
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from freetoken.api import default_model_path
from freetoken.config import EngineConfig
from freetoken.engine import Engine
from serve_support import http, live_server

KEY = "admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
COMPLETION = {"model": "default", "prompt": "def fibonacci(n):", "temperature": 0,
              "max_tokens": 24}


@pytest.fixture(scope="module")
def served():
    engine = Engine(default_model_path(), EngineConfig(device="cpu", ctx_size=256,
                                                       expert_cache_frac=0.5))
    with live_server(engine, name="default", api_key=KEY) as (url, worker):
        yield engine, url, worker
    engine.close()


def resize(url, body, headers=AUTH):
    return http("POST", url + "/admin/expert-cache", body, headers=headers)


def gb(engine, slots: int) -> float:
    return (slots + 0.5) * engine.memory_plan.slot_bytes / 1e9


def scrape(url) -> dict:
    status, text = http("GET", url + "/metrics", headers=AUTH)
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_route_needs_the_key(served):
    engine, url, _ = served
    slots, before = engine.memory_plan.num_slots, engine.resizes["admin"]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, body = resize(url, {"gb": gb(engine, 4)}, headers)
        assert status == 401 and "API key" in body["error"]["message"]
    assert engine.memory_plan.num_slots == slots and engine.resizes["admin"] == before


@pytest.mark.parametrize("body, needle", [
    ({"gb": -1}, "gb: Input should be greater than or equal to 0"),
    ({"gb": "half"}, "gb: Input should be a valid number"),
    ({}, "gb: Field required"),
    ({"gb": 0.001, "slots": 3}, "slots: unknown field"),
    ({"gb": 1e6}, "larger than all the model's experts"),  # the engine's ConfigError
])
def test_bad_values_are_400(served, body, needle):
    engine, url, _ = served
    slots = engine.memory_plan.num_slots
    status, answer = resize(url, body)
    assert status == 400 and needle in answer["error"]["message"], answer
    assert answer["error"]["param"] in ("gb", None)
    assert engine.memory_plan.num_slots == slots


def test_resize_answers_the_plan_and_metrics_follow(served, monkeypatch):
    engine, url, worker = served
    before = engine.resizes["admin"]
    checked, resize_cache = [], engine.resize_expert_cache

    def resize_and_check(*args, **kw):  # on the engine's thread, between two steps: the books
        done = resize_cache(*args, **kw)  # are not moving under the check there
        engine.experts.cache.check_integrity()
        checked.append(done.new_slots)
        return done
    monkeypatch.setattr(engine, "resize_expert_cache", resize_and_check)
    status, text = http("POST", url + "/v1/completions", COMPLETION, headers=AUTH)
    assert status == 200
    expected = text["choices"][0]["text"]
    total = engine.memory_plan.num_experts
    results = []

    def complete():  # a completion running while the resizes arrive
        results.append(http("POST", url + "/v1/completions", COMPLETION, headers=AUTH))
    thread = threading.Thread(target=complete)
    thread.start()
    for slots in (total // 4, 3 * total // 4, 2):
        status, answer = resize(url, {"gb": gb(engine, slots)})
        assert status == 200, answer
        assert answer["plan"]["num_slots"] == slots == engine.experts.cache.capacity
        assert answer["plan"]["expert_cache"] == slots * answer["plan"]["slot_bytes"]
        assert answer["resize"]["new_slots"] == slots and answer["resize"]["trigger"] == "admin"
        assert answer["resize"]["pause_ms"] >= 0
    thread.join()
    assert checked == [total // 4, 3 * total // 4, 2]
    assert results[0][0] == 200 and results[0][1]["choices"][0]["text"] == expected
    assert worker.wait_idle(60)
    m = scrape(url)
    assert m[("freetoken_expert_cache_slots", ())] == 2
    assert m[("freetoken_expert_cache_bytes", ())] == engine.memory_plan.expert_cache > 0
    assert m[("freetoken_expert_cache_resizes_total", (("trigger", "admin"),))] == before + 3
    assert m[("freetoken_expert_cache_resizes_total", (("trigger", "memory"),))] == \
        engine.resizes["memory"]
    assert m[("freetoken_requests_total", (("endpoint", "/admin/expert-cache"),
                                           ("status", "200")))] >= 3


def test_an_idle_server_still_gives_memory_back(served):
    engine, url, worker = served
    assert worker.wait_idle(60)
    planned = engine.memory_plan.num_experts // 2
    status, _ = resize(url, {"gb": gb(engine, planned)})  # what the watch grows back to
    assert status == 200 and engine.watch.target_slots == planned
    before = engine.resizes["memory"]
    probed = threading.Event()

    def probe(free):
        def read():
            probed.set()
            return free
        return read

    def slots_after_the_next_check(free):
        """The cache's slots once the idle worker's watch has probed `free` bytes (read on the
        engine's thread, after that check)."""
        probed.clear()
        engine.watch.probe = probe(free)
        assert probed.wait(60), "the idle worker never let the watch look"
        return asyncio.run(worker.call(lambda e: e.experts.cache.capacity))

    try:
        assert slots_after_the_next_check(0) == 0  # another program took it all
        assert slots_after_the_next_check(10 ** 15) == planned  # and gave it back
    finally:
        engine.watch.probe = lambda: 10 ** 15
    assert engine.resizes["memory"] == before + 2
