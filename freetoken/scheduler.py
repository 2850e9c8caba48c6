"""Scheduler: the engine's requests run together (continuous batching). One step():

    1. admit waiting requests, oldest first, while fewer than `parallel` run and the KV pool
       can hold each one's prompt + max tokens beside what the running ones may still need
       (a reservation: no step ever runs out of pages); a request takes its longest cached
       prefix from the prefix cache when it is on;
    2. one prefill forward of --prefill-chunk tokens at most: the next chunk of each admitted
       request that still has prompt tokens to forward, oldest first, packed into one forward
       while the token budget lasts (MoETransformer.forward_packed: on cuda each streamed layer
       crosses the link once for all of them); a request's last chunk's last row gives its
       first token;
    3. one decode step for every request that is generating: one forward for all of them
       (model.forward_batch: one expert step for their B tokens), or for a single one the
       engine's decode step (its captured CUDA graphs on cuda). While a prefill chunk runs,
       these steps run beside it instead, their misses on the CPU while the prefill's expert
       layers stream over the link, so a long prompt does not freeze the sequences already
       generating: between its MoE layers (one every decode_beside_every layers: beside.Interleaved), or
       with tuning decode_beside "thread" back to back on a thread (and CUDA stream) of their
       own while the forward streams every layer (beside.Thread).

Hybrid models (recurrent state, anchors.py): a request restores the state kept with its cached
prefix; a prefill chunk's forward takes its state at each of its state points inside the chunk
(chunks do not end there), and they go to the prefix cache in order; while decoding its state
is cached after a closer token, at a page boundary every --state-interval tokens, and where it
ends (partial pages included: kv/radix.py).

Requests join and leave between steps. Each request's tokens come out as events it holds
until the caller takes them (Request.take). Not thread-safe: one thread owns a Scheduler
(server/worker.py runs it on the engine's thread); the decode thread of beside.Thread lives
only inside step(), which joins it before it returns.
"""
import collections
import logging
import time
from typing import Optional

import torch

from . import anchors as anchor_rules
from .beside import Interleaved, Thread
from .anchors import next_chunk_end
from .errors import ConfigError
from .sampling import SamplingParams, make_generator, sample, token_logprobs
from .sequence import Sequence
from .stats import GenerationStats
from .tokenizer import TextStream

# DEBUG: one line per step (what it ran, how long, graph captures; tools/bench_agent.py
# --step-log); off, a step pays one isEnabledFor call
log = logging.getLogger("freetoken.scheduler")


class Request:
    """One generation: its prompt, sampling, Sequence and KV, and what it produced. `events`
    holds generated token ids not yet taken; `finished` once it has ended (stats.stop_reason
    says why: eos | stop | length | context | interrupted)."""

    def __init__(self, prompt_ids: list, params: SamplingParams, constraint, prefix_cache: bool,
                 stats: GenerationStats, device):
        self.prompt_ids, self.params, self.constraint = prompt_ids, params, constraint
        self.prefix_cache, self.stats = prefix_cache, stats
        n = len(prompt_ids)
        self.tokens = torch.empty(n + params.max_tokens, dtype=torch.int64, device=device)
        self.tokens[:n] = torch.tensor(prompt_ids, dtype=torch.int64)
        self.seq: Optional[Sequence] = None
        self.kv = self.state = None
        self.num_forwarded = 0  # prompt tokens with K/V written (cached ones included)
        self.state_points: list = []  # prefill positions where the state is cached (anchors.py)
        self.boundary = None  # StateSnapshot at the latest page boundary decode passed
        self.num_saved = 0  # tokens of the deepest state cached for it (or restored)
        self.logits = None  # [V] fp32: the row the next token is sampled from
        self.num_generated = 0  # tokens sampled and kept (EOS not counted)
        self.events = collections.deque()
        self.finished = False
        self.experts_before: dict = {}
        self.gen = self.stop = None
        self.number = 0  # the scheduler's count of submits when this one came (the step log)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefilling(self) -> bool:
        return self.seq is not None and self.num_forwarded < self.num_prompt_tokens

    def take(self) -> list:
        """The token ids generated since the last take()."""
        out = list(self.events)
        self.events.clear()
        return out


class Scheduler:
    """The engine's requests (engine.py owns one). submit() -> Request; step() runs one
    scheduling step; cancel() ends a request at once, its pages released."""

    def __init__(self, engine, parallel: int):
        self.engine, self.parallel = engine, parallel
        self.waiting = collections.deque()
        self.running: list = []  # admitted, in admission order
        self.decode_stream = None  # cuda: the decode thread's stream (beside.Thread), made once
        self.num_submitted = 0

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def submit(self, prompt_ids: list, params: SamplingParams, constraint=None,
               prefix_cache: bool = True) -> Request:
        """Queues a generation (the engine has checked that it can ever fit)."""
        eng = self.engine
        st = GenerationStats(load_s=eng.load_s, device=eng.device.type,
                             num_prompt_tokens=len(prompt_ids))
        st.stop_reason = "interrupted"  # until the request ends otherwise
        req = Request(list(prompt_ids), params, constraint, prefix_cache, st, eng.device)
        self.num_submitted += 1
        req.number = self.num_submitted
        req.stop = TextStream(eng.tokenizer, params.stop) if params.stop else None
        req.gen = make_generator(params.seed, eng.device)
        self.waiting.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """Ends req where it stands (waiting or running); its pages go back."""
        if req.finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "interrupted")

    def step(self) -> None:
        """Admissions, one prefill chunk, decode steps (the module docstring)."""
        timed = log.isEnabledFor(logging.DEBUG)
        if timed:
            before = self._step_marks()
        self._admit()
        prefilling = [r for r in self.running if r.prefilling]
        decoding = [r for r in self.running if not r.prefilling]
        beside = None
        if prefilling:
            beside = self._prefill_chunks(prefilling, decoding)
        if decoding and (beside is None or not beside.steps):
            self._decode([r for r in decoding if not r.finished])
        if timed:
            log.debug(self._step_line(before, prefilling, decoding, beside))

    def _step_marks(self) -> tuple:
        graphs = self.engine.graphs
        forwarded = {id(r): r.num_forwarded for r in self.running}
        return (time.perf_counter(), graphs.captures if graphs is not None else 0, forwarded,
                {id(r) for r in self.running})

    def _step_line(self, before, prefilling: list, decoding: list, beside) -> str:
        """The step log's line: its time (the device synced), the chunks it prefilled (request
        number: tokens forwarded), its decode steps, the graphs it captured, the queue."""
        t0, captures, forwarded, running = before
        self.engine.sync()
        graphs = self.engine.graphs
        admitted = [r.number for r in self.running if id(r) not in running]
        done = [(r, r.num_forwarded - forwarded.get(id(r), r.seq.num_cached_tokens))
                for r in prefilling]
        chunks = ", ".join(f"#{r.number}: {n}{' (last)' if not r.prefilling else ''}"
                           for r, n in done if n > 0)
        steps = beside.steps if beside is not None and beside.steps else (1 if decoding else 0)
        where = (type(beside).__name__.lower() if beside is not None and beside.steps
                 else "after")
        return (f"step {1e3 * (time.perf_counter() - t0):8.1f} ms | admitted {admitted or '-'} | "
                f"prefill {chunks or '-'} | decode B={len(decoding)} x {steps} ({where}) | "
                f"captured {(graphs.captures if graphs is not None else 0) - captures} | "
                f"waiting {len(self.waiting)}")

    # ---- admission ------------------------------------------------------------------------

    def _admit(self) -> None:
        eng = self.engine
        while self.waiting and len(self.running) < self.parallel:
            req = self.waiting[0]
            short = self._pages_needed(req) - self._pages_available()
            if short > 0 and not eng.grow_kv_pool(short):  # (memory lent by the expert cache)
                if not self.running:  # nothing will free pages: engine.check_prompt prevents this
                    raise ConfigError("a request does not fit the empty KV pool")
                return  # waits for running requests to end
            self.waiting.popleft()
            req.experts_before = dict(eng.experts.stats)
            req.seq = Sequence.from_prompt(req.prompt_ids)
            use_cache = req.prefix_cache and eng.recorder is None
            snapshot = eng.kv_manager.admit(req.seq, use_cache=use_cache)
            req.kv = eng.sequence_kv(req.seq)
            req.state = eng.new_state()
            if snapshot is not None:
                req.state.restore(snapshot)
            req.num_forwarded = req.stats.cached_tokens = req.seq.num_cached_tokens
            req.num_saved = req.num_forwarded
            req.state_points = eng.state_points(req.seq, req.num_forwarded)
            if eng.recorder is not None:
                eng.recorder.start()
            self.running.append(req)

    def _pages_needed(self, req: Request) -> int:
        """Pages req may hold at most: its prompt + max tokens (within a sequence's limit)."""
        eng = self.engine
        n = min(req.num_prompt_tokens + req.params.max_tokens, eng.max_seq_tokens)
        return eng.kv_manager.pool.pages_for(n)

    def _pages_available(self) -> int:
        """Free + evictable pages, less what running requests may still take."""
        mgr = self.engine.kv_manager
        reserved = sum(max(0, self._pages_needed(r) - len(r.seq.page_table)) for r in self.running)
        return mgr.num_available([r.seq for r in self.running]) - reserved

    # ---- prefill and decode ---------------------------------------------------------------

    def _prefill_chunks(self, prefilling: list, decoding: list):
        """One forward of the next chunks of `prefilling` (oldest first) within --prefill-chunk
        tokens and anchors.SNAPSHOTS_PER_FORWARD kept states: the first always gets a chunk; the
        rest while both budgets last. The states at the chunks' state points are taken inside
        the forward and go to the prefix cache in order, as if each had ended a chunk. The
        `decoding` requests' steps run beside the forward (_beside); returns what ran them
        (its `steps`), or None."""
        eng = self.engine
        budget, snap_budget = eng.config.prefill_chunk, anchor_rules.SNAPSHOTS_PER_FORWARD
        reqs, spans, snaps = [], [], []
        for req in prefilling:
            start = req.num_forwarded
            end = next_chunk_end(start, req.num_prompt_tokens, budget, req.state_points,
                                 snap_budget)
            if end == start:  # either budget used up
                break
            kept = [p for p in req.state_points if p <= end]  # taken inside the forward
            del req.state_points[:len(kept)]
            snaps.append(req.state.snapshots_at(kept) if kept else [])
            reqs.append(req)
            spans.append((start, end))
            budget -= end - start
            snap_budget -= len(kept)
        beside = self._beside(decoding, sum(b - a for a, b in spans))
        if isinstance(beside, Thread):
            for req, (a, b) in zip(reqs, spans):
                # NOTE: the chunks' pages now, on this thread: during the forward the decode
                # thread alone touches the KV books (its pages, its ends, the prefix tree)
                req.kv.reserve(b - a)
            with beside, eng.experts.prefill_beside_thread():
                logits = self._forward(reqs, spans, snaps)
        else:
            logits = self._forward(reqs, spans, snaps, beside)
        done = []
        for b, (req, (_, end), kept) in enumerate(zip(reqs, spans, snaps)):
            req.num_forwarded = end
            req.stats.num_prefill_forwards += 1
            for snap in kept:
                is_end = eng.anchors.is_end(req.seq.tokens, snap.num_tokens, req.num_prompt_tokens)
                self._save(req, snap, is_end)
            if end == req.num_prompt_tokens:
                req.logits = logits[b]
                done.append(req)
        if done:
            eng.sync()
            now = time.perf_counter()
            for req in done:
                req.stats.prefill_s = now - req.stats.t_start
            self._sample(done)
        return beside

    def _forward(self, reqs: list, spans: list, snaps: list, between=None) -> torch.Tensor:
        """The prefill forward of reqs' chunks -> logits [B, V] of each chunk's last token."""
        eng = self.engine
        if len(reqs) == 1:
            (req,), ((start, end),) = reqs, spans
            return eng.forward(req.kv, req.tokens[start:end], num_logits=1, state=req.state,
                               between=between, snapshots=snaps[0])[-1:]
        return eng.forward_packed([r.kv for r in reqs],
                                  [r.tokens[a:b] for r, (a, b) in zip(reqs, spans)],
                                  [r.state for r in reqs], between=between, snapshots=snaps)

    def _beside(self, decoding: list, num_tokens: int):
        """What runs decoding's steps beside a prefill forward of num_tokens tokens: with
        tuning decode_beside "thread" a beside.Thread where the forward streams every layer
        (runtime.streams_every_layer), else a beside.Interleaved every decode_beside_every layers (0:
        none, the steps run after the chunk)."""
        tuning = self.engine.config.tuning
        if not decoding:
            return None
        streams = getattr(self.engine.experts, "streams_every_layer", None)
        if tuning.decode_beside == "thread" and streams is not None and streams(num_tokens):
            return Thread(self, decoding)
        if tuning.decode_beside_every:
            return Interleaved(self, decoding, tuning.decode_beside_every)
        return None

    def _decode(self, reqs: list) -> None:
        if not reqs:
            return
        eng = self.engine
        if len(reqs) == 1:
            r = reqs[0]
            n = r.num_prompt_tokens + r.num_generated
            r.logits = eng.decode(r.kv, r.tokens[n - 1:n], r.state)[0]
        else:
            ids = torch.stack([r.tokens[r.num_prompt_tokens + r.num_generated - 1] for r in reqs])
            logits = eng.decode_batch(ids, [r.kv for r in reqs], [r.state for r in reqs])
            for b, r in enumerate(reqs):
                r.logits = logits[b]
        for r in reqs:
            self._keep_state(r)
        self._sample(reqs)

    def _keep_state(self, r: Request) -> None:
        """After a decode step of r: its state after a closer token goes to the prefix cache at
        once; its state at each page boundary becomes r.boundary, cached once --state-interval
        tokens passed since the last state cached (its end's state is cached in _finish; its
        prompt's state points in _prefill_chunks)."""
        anchors = self.engine.anchors
        if anchors is None or r.state is None:
            return
        n = r.state.num_tokens
        if n > r.num_prompt_tokens:  # n - 1 is a generated token
            if anchors.is_closer(r.seq.tokens[n - 1]):
                self._save(r, r.state.snapshot())
            elif n % anchors.page_size == 0:
                r.boundary = r.state.snapshot()
            if r.boundary is not None and r.boundary.num_tokens - r.num_saved >= anchors.interval:
                self._save(r, r.boundary)

    def _save(self, r: Request, snapshot, is_end: bool = False) -> None:
        if snapshot.num_tokens > r.num_saved:
            self.engine.save_state(r.seq, snapshot, is_end)
            r.num_saved = snapshot.num_tokens

    def _sample(self, reqs: list) -> None:
        """Samples each request's next token from its logits (one host sync for all), then
        keeps it or ends the request."""
        at = []
        for r in reqs:
            i = r.num_prompt_tokens + r.num_generated
            row = r.logits if r.constraint is None else r.constraint.mask(r.logits)
            r.tokens[i] = sample(row, r.params, r.gen, r.tokens[:i])  # on the device
            at.append(i)
        ids = torch.stack([r.tokens[i] for r, i in zip(reqs, at)]).tolist()  # the one sync
        for r, token_id in zip(reqs, ids):
            self._keep(r, token_id)

    def _keep(self, r: Request, token_id: int) -> None:
        st, params = r.stats, r.params
        self.engine.count_token(st)
        if params.logprobs is not None:
            st.logprobs.append(token_logprobs(r.logits, token_id, params.logprobs))
        if r.constraint is not None:
            r.constraint.advance(token_id)
        if token_id in self.engine.eos_ids and not params.ignore_eos:
            self._finish(r, "eos")
            return
        r.seq.tokens.append(token_id)
        r.num_generated += 1
        r.events.append(token_id)
        reason = None
        if r.stop is not None:
            r.stop.push(token_id)
            if r.stop.stopped:
                reason = "stop"
        if reason is None and r.num_generated == params.max_tokens:
            reason = "length"
        if reason is None and r.kv.num_free == 0:
            reason = "context"
        if reason:
            self._finish(r, reason)

    def _finish(self, r: Request, reason: str) -> None:
        eng = self.engine
        st = r.stats
        st.stop_reason = reason
        if r in self.running:
            self.running.remove(r)
            if self.engine.anchors is not None and r.state is not None:
                self._save(r, r.state.snapshot(), True)  # where the next turn resumes
            eng.end_request(r)
        r.finished = True
        r.logits = None

