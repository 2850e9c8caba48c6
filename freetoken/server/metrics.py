"""Prometheus metrics of one server, in their own registry (several servers in one process, as
in tests, do not collide): requests by endpoint and status, TTFT and time per output token,
queue depth, running sequences, tokens, prefix-cache hit tokens, the expert runtime's
hits/misses, fills and bytes over PCIe, evictions and experts run on the CPU, and the expert
cache's size and resizes."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
# the expert runtime's counters (experts/runtime.py STAT_KEYS) exported as
# freetoken_expert_<name>_total, with their help text
EXPERT_COUNTERS = {
    "hits": "Routed experts found in the expert cache",
    "misses": "Routed experts not in the expert cache",
    "fills": "Experts copied into the expert cache (host to device)",
    "bytes_filled": "Bytes copied into the expert cache (PCIe, host to device)",
    "bytes_streamed": "Bytes of whole expert layers streamed for prefill (PCIe, host to device)",
    "evictions": "Experts evicted from the expert cache",
    "cpu_experts": "Experts run on the CPU"}


class Metrics:
    """Thread-safe (prometheus_client is): the worker thread calls job_done, routes count
    requests, /metrics calls render()."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("freetoken_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("freetoken_time_to_first_token_seconds",
                              "Admission to first generated token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.tpot = Histogram("freetoken_time_per_output_token_seconds",
                              "Decode time per token after the first", buckets=TOKEN_BUCKETS,
                              registry=r)
        self.queue_depth = Gauge("freetoken_queue_depth", "Requests waiting for the engine",
                                 registry=r)
        self.running = Gauge("freetoken_running_sequences", "Sequences being generated",
                             registry=r)
        self.prompt_tokens = Counter("freetoken_prompt_tokens", "Prompt tokens of finished "
                                     "generations", registry=r)
        self.generated_tokens = Counter("freetoken_generated_tokens", "Tokens generated",
                                        registry=r)
        self.cached_tokens = Counter("freetoken_prefix_cache_hit_tokens", "Prompt tokens whose "
                                     "KV was reused (the engine's own count)", registry=r)
        self.experts = {name: Counter(f"freetoken_expert_{name}", text, registry=r)
                        for name, text in EXPERT_COUNTERS.items()}
        self.kv_pages = Gauge("freetoken_kv_pages", "KV pages by state: held by running "
                              "sequences, kept only by the prefix cache (evictable), free",
                              ["state"], registry=r)
        self.states = Gauge("freetoken_kept_states", "Recurrent states kept at anchors in the "
                            "prefix cache (hybrid models)", registry=r)
        self.state_bytes = Gauge("freetoken_kept_state_bytes", "Bytes of the recurrent states "
                                 "kept at anchors", registry=r)
        self.cache_bytes = Gauge("freetoken_expert_cache_bytes", "Bytes of the expert cache now "
                                 "(it is resized at run time)", registry=r)
        self.cache_slots = Gauge("freetoken_expert_cache_slots", "Experts the expert cache holds "
                                 "now (its slots)", registry=r)

    def bind(self, worker) -> None:
        """Read the queue, KV page and expert cache gauges from `worker` (and its engine) at
        every scrape."""
        self.queue_depth.set_function(lambda: worker.num_waiting)
        self.running.set_function(lambda: worker.num_running)
        manager = getattr(worker.engine, "kv_manager", None)  # (read at a scrape: plain ints)
        if manager is not None:
            pool = manager.pool
            self.kv_pages.labels("free").set_function(lambda: pool.num_free)
            self.kv_pages.labels("evictable").set_function(lambda: manager.num_evictable_pages)
            self.kv_pages.labels("in_use").set_function(
                lambda: pool.num_pages - pool.num_free - manager.num_evictable_pages)
            radix = manager.radix
            if radix is not None:
                self.states.set_function(lambda: radix.num_states)
                self.state_bytes.set_function(lambda: radix.num_state_bytes)
        engine = worker.engine
        if getattr(engine, "resizes", None) is not None:  # (a loaded Engine, read at a scrape)
            self.cache_bytes.set_function(lambda: engine.memory_plan.expert_cache)
            self.cache_slots.set_function(lambda: engine.memory_plan.num_slots)
            self.registry.register(_Resizes(engine))

    def job_done(self, finish, stats) -> None:
        """Count a finished job (stats: the engine's GenerationStats of it, or None)."""
        self.prompt_tokens.inc(finish.num_prompt_tokens)
        self.generated_tokens.inc(finish.num_generated)
        self.cached_tokens.inc(finish.num_cached_tokens)
        if stats is None or finish.reason == "error":
            return
        if stats.num_decoded:
            self.tpot.observe(stats.decode_s / stats.num_decoded)
        for name, counter in self.experts.items():
            value = stats.experts.get(name, 0)
            if isinstance(value, (int, float)) and value > 0:
                counter.inc(value)

    def render(self) -> tuple:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Resizes:
    """freetoken_expert_cache_resizes_total{trigger}: the engine's own count of the expert
    cache's resizes (Engine.resizes: api, admin, memory, kv), read at every scrape."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        family = CounterMetricFamily("freetoken_expert_cache_resizes", "Resizes of the expert "
                                     "cache by trigger (api, admin route, memory watch, "
                                     "kv: memory lent to the KV pool and given back)",
                                     labels=["trigger"])
        for trigger, n in self.engine.resizes.items():
            family.add_metric([trigger], n)
        yield family
