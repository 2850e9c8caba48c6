"""The KV pool's elastic trigger (issue 37): a request waiting only for KV pages grows the page
pool by what it lacks plus a step of slack, the bytes taken from the expert cache (resize trigger
"kv"); once nothing waits, the running requests' reservations fit the planned pool less the
slack and none holds a page past it, the prefix tree's pages there are evicted (LRU, whole
leaves) and the pool shrinks back, the cache growing back by the slots it gave. Owns when and by
how much; the moves are KVPages.resize (storage), PagePool.resize (ids) and
Engine.resize_expert_cache (the cache).

    grow by     short + slack pages (slack = planned pages / 8, at least 1), or just short when
                the cache cannot give the slack; at most `parallel` sequences of max_seq_tokens
    takes       ceil(pages x page bytes / slot bytes) slots: the plan's total never grows, so a
                grow never passes its budget; refused (the request waits) when the cache has
                fewer slots
    gives back  every added page at once; the cache grows by the slots it gave (within the
                plan's budget and all the experts)

NOTE: page ids stay valid across both moves (pages below both sizes keep their contents), so page
tables, the prefix tree and running sequences are untouched. The storage is new: the decode
graphs, which hold its address, are captured again (DecodeGraphs.release/reset). On cuda the new
storage is allocated beside the old when that fits above the plan's margin, else staged through
host memory (KVPages.resize).
"""
import math
import time
from dataclasses import replace

from .memory_plan import GB
from .memory_watch import device_free, log


class KVGrow:
    """Lends expert-cache memory to `engine`'s KV pool (an Engine: kv_pages, kv_manager,
    scheduler, memory_plan, graphs, resize_expert_cache). grow(n) is the scheduler's call at
    admission; after_step() is Engine.step's. `refused` says why the latest grow was refused
    ('' once one succeeds); num_grows / num_returns count the moves."""

    def __init__(self, engine):
        self.engine = engine
        self.base_pages = engine.kv_pages.num_pages  # the planned pool: never below it
        P = engine.kv_pages.page_size
        full = -(-engine.max_seq_tokens // P) * engine.config.parallel
        self.max_pages = max(self.base_pages, full)  # more could never be held at once
        self.slack = max(1, self.base_pages // 8)
        self.slots_lent = 0  # the cache's slots the added pages stand for
        self.num_grows = self.num_returns = 0
        self.refused = ""

    @property
    def num_added(self) -> int:
        return self.engine.kv_pages.num_pages - self.base_pages

    def grow(self, short: int) -> bool:
        """Adds at least `short` pages (free) to the pool, shrinking the expert cache by their
        bytes; False, the pool as it was, when the cache cannot give them or the pool is at
        its bound."""
        eng = self.engine
        plan, pages = eng.memory_plan, eng.kv_pages
        stride, page_bytes = plan.slot_bytes, pages.page_bytes
        room = self.max_pages - pages.num_pages
        for n in (min(short + self.slack, room), short):
            slots = math.ceil(n * page_bytes / stride) if stride else 0
            if short <= n <= room and stride and slots <= plan.num_slots:
                break
        else:
            why = (f"the pool is at its bound of {self.max_pages} pages" if short > room else
                   f"the pages it lacks take more than the expert cache's {plan.num_slots} slots")
            if why != self.refused and plan.num_slots:  # (no cache: nothing was to be lent)
                log.info("KV pool not grown (a request waits): %s", why)
            self.refused = why
            return False
        t0 = time.perf_counter()
        eng.resize_expert_cache((plan.num_slots - slots + 0.5) * stride / GB, trigger="kv",
                                reason=f"{n} KV pages for a waiting request")
        self._resize_pages(pages.num_pages + n)
        self.slots_lent += slots
        self.num_grows += 1
        self.refused = ""
        log.info("KV pool %d -> %d pages (%d taken from the expert cache), pause %.1f ms",
                 pages.num_pages - n, pages.num_pages, slots, (time.perf_counter() - t0) * 1e3)
        return True

    def after_step(self) -> None:
        """Gives the added pages back when nothing waits, no running sequence holds one and
        the running ones' reservations fit the planned pool less the slack (the prefix tree's
        pages there are evicted first, LRU: cached pages below go with their leaves)."""
        eng = self.engine
        if not self.num_added or eng.scheduler.waiting:
            return
        base, running = self.base_pages, eng.scheduler.running
        # the running requests' reservations (scheduler.py: pages they may still take) must fit
        # the planned pool with the slack to spare (else the next request grows it again at
        # once), and none may hold an added page
        if sum(eng.scheduler._pages_needed(r) for r in running) > base - self.slack or \
                any(p >= base for r in running for p in r.seq.page_table):
            return
        mgr = eng.kv_manager
        held = sum(1 for r in mgr.pool.refs[base:] if r)
        while held and mgr.radix is not None and mgr.radix.evict(held):
            held = sum(1 for r in mgr.pool.refs[base:] if r)
        if held:  # (held outside the scheduler: Engine.sequence's, while it runs)
            return
        t0 = time.perf_counter()
        added = self.num_added
        self._resize_pages(base)
        plan, lent = eng.memory_plan, self.slots_lent
        self.slots_lent = 0
        self.num_returns += 1
        new = min(plan.num_slots + lent, plan.num_experts,
                  (plan.budget - plan.context_part) // plan.slot_bytes)
        target = eng.watch.target_slots if eng.watch is not None else 0
        if new > plan.num_slots:
            eng.resize_expert_cache((new + 0.5) * plan.slot_bytes / GB, trigger="kv",
                                    reason=f"{added} KV pages given back")
        if eng.watch is not None:  # the rest, where the budget kept the cache below, the watch
            eng.watch.target_slots = target + lent  # grows back when memory allows
        log.info("KV pool %d -> %d pages (given back), pause %.1f ms", base + added, base,
                 (time.perf_counter() - t0) * 1e3)

    def _resize_pages(self, num_pages: int) -> None:
        """Storage and ids to num_pages pages; the plan's kv follows; graphs captured again."""
        eng = self.engine
        pages, plan = eng.kv_pages, eng.memory_plan
        page_bytes = pages.page_bytes
        new_bytes = num_pages * page_bytes
        staged = (eng.device.type == "cuda" and
                  device_free(eng.device, new_bytes + plan.margin) < new_bytes + plan.margin)
        if eng.graphs is not None:
            eng.graphs.release()  # they hold the old storage's address
        if num_pages > pages.num_pages:
            pages.resize(num_pages, staged)
            eng.kv_manager.pool.resize(num_pages)
        else:
            eng.kv_manager.pool.resize(num_pages)
            pages.resize(num_pages, staged)
        if eng.graphs is not None:
            eng.graphs.reset()
        P = pages.page_size
        eng.memory_plan = replace(plan, kv=pages.data.nbytes, kv_tokens=num_pages * P,
                                  kv_lent=(num_pages - self.base_pages) * P)
        eng.sync()
