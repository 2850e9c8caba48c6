"""EngineWorker: the engine on its own thread behind a bounded admission count. The event loop
submits a Job and reads its events (text pieces, then one Finish) without ever blocking.

The thread hands every job to the engine's scheduler (scheduler.py: up to --parallel sequences
decode together, the rest wait there) and steps it while any job is active, posting each job's
new text after every step; between steps it runs the calls routes hand it (call(): the admin
route's resize), and while idle it lets the engine's memory watch look now and then (a server
waiting for requests still gives memory back). Routes see only submit(), call(), Job, Piece and
Finish.
"""
import asyncio
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from ..sampling import SamplingParams
from ..tokenizer import TextStream

log = logging.getLogger("freetoken.serve")

IDLE_WATCH_S = 0.1  # how often an idle worker lets the engine's memory watch look (Engine.idle)

# the engine's stop reasons -> the APIs' two kinds (eos or stop string: "stop"; budget: "length")
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length",
          "interrupted": "cancelled"}


class QueueFull(Exception):
    """More requests are admitted than ServeConfig.max_queue; the client should retry later."""


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's text, log-probability, and the top alternatives' (text, logprob),
    best first (empty unless asked)."""
    token: str
    logprob: float
    top: tuple = ()


@dataclass(frozen=True)
class Piece:
    """New text of the generation (never half a character; stop strings held back). logprobs:
    the tokens generated since the last piece, when the job asked (SamplingParams.logprobs); the
    last piece before Finish may then have no text."""
    text: str
    logprobs: tuple = ()


@dataclass(frozen=True)
class Finish:
    """The last event of every job. reason: stop | length | cancelled | error. stop_string: the
    stop string that ended it (reason stop), else None. num_cached_tokens: prompt tokens the
    engine did not compute again (its own count)."""
    reason: str
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated: int = 0
    stop_string: Optional[str] = None
    error: Optional[str] = None


@dataclass
class Job:
    """One request's generation. The worker thread posts events to `loop`; the loop side reads
    them with `await next_event()` and may cancel() at any time (a queued job never starts, a
    running one stops before its next token). constraint: the engine's (a grammar), or None."""
    prompt_ids: list
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    constraint: object = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    t_submit: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.cancelled.set()

    async def next_event(self):
        return await self.events.get()

    def post(self, event) -> None:
        """From the worker thread: hand `event` to the loop (dropped if the loop has closed)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            pass


class _Call:
    """fn(engine), to run on the engine's thread between two steps; its result (or exception)
    goes to `future` on `loop`."""

    def __init__(self, fn, loop: asyncio.AbstractEventLoop):
        self.fn, self.loop = fn, loop
        self.future = loop.create_future()

    def run(self, engine) -> None:
        try:
            result, error = self.fn(engine), None
        except Exception as e:  # handed to the caller: it decides the answer
            result, error = None, e
        try:
            self.loop.call_soon_threadsafe(self._settle, result, error)
        except RuntimeError:  # the loop has closed
            pass

    def _settle(self, result, error) -> None:
        if self.future.done():  # the caller went away
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)


class _Active:
    """A job the engine holds: its scheduler request and what has been posted of it."""

    def __init__(self, job: Job, req, tokenizer):
        self.job, self.req = job, req
        self.text = TextStream(tokenizer, job.params.stop)
        self.generated: list = []
        self.t_first: Optional[float] = None


class EngineWorker:
    """Owns `engine` (an Engine: submit(ids, params, constraint) -> a request with take(),
    finished and stats; step(); cancel(request); tokenizer) and the one thread that calls it.
    submit() is safe from the event loop; close() joins the thread. `metrics` (or None) is told
    about every finished job."""

    def __init__(self, engine, max_queue: int, metrics=None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.ctx_size = engine.config.ctx_size
        self.max_queue = max_queue
        self.metrics = metrics
        self._jobs = queue.Queue()
        self._lock = threading.Condition()  # notified when a job ends
        self.num_admitted = 0  # running + waiting
        self.num_running = 0  # jobs the engine holds (running or in its own waiting queue)
        self.running_job: Optional[Job] = None  # the latest job handed to the engine
        self._active: list = []  # _Active, in arrival order (the worker thread's alone)
        # the expert runtime's counters as last reported: jobs that ran together share steps,
        # so each finished job reports the counters' growth since the last report, once
        runtime = getattr(engine, "experts", None)
        self._experts_seen = dict(runtime.stats) if runtime is not None else None
        self._thread = threading.Thread(target=self._loop, name="freetoken-engine", daemon=True)
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        return self.num_admitted - self.num_running

    def submit(self, prompt_ids: list, params: SamplingParams, constraint=None) -> Job:
        """Admit a generation, or raise QueueFull. Call from the event loop. constraint: a fresh
        one per job (it keeps the job's grammar state)."""
        with self._lock:
            if self.num_admitted >= self.max_queue:
                raise QueueFull(f"{self.num_admitted} requests are already admitted "
                                f"(--max-queue {self.max_queue})")
            self.num_admitted += 1
        job = Job(list(prompt_ids), params, asyncio.get_running_loop(), constraint)
        self._jobs.put(job)
        return job

    async def call(self, fn):
        """fn(engine) run on the engine's thread at the next safe point between two steps (at
        once when idle); returns its result or raises its exception. Call from the event loop,
        which waits without blocking (an admin route's resize: Engine.resize_expert_cache)."""
        call = _Call(fn, asyncio.get_running_loop())
        self._jobs.put(call)
        return await call.future

    def wait_idle(self, timeout_s: float) -> bool:
        """Blocks until no job is admitted (every finished one has released its KV pages);
        False when timeout_s passed first. Not for the event loop: tests and shutdown."""
        with self._lock:
            return self._lock.wait_for(lambda: self.num_admitted == 0, timeout_s)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _loop(self) -> None:
        # an idle engine's memory watch (Engine.idle) still runs, every IDLE_WATCH_S at most
        idle = getattr(self.engine, "idle", None) if getattr(self.engine, "watch", None) else None
        while True:
            busy = bool(self._active)
            try:  # idle: wait for a job; busy: take what arrived and step on
                job = self._jobs.get(block=not busy,
                                     timeout=IDLE_WATCH_S if idle and not busy else None)
            except queue.Empty:
                if not busy:  # idle and nothing came
                    self._idle(idle)
                    continue
                job = False
            while job is not False:
                if job is None:  # close(): end what runs, then the thread
                    for a in list(self._active):
                        self._cancel(a)
                    return
                if isinstance(job, _Call):  # between steps: the engine is not inside one
                    job.run(self.engine)
                else:
                    self._start(job)
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    job = False
            for a in list(self._active):
                if a.job.cancelled.is_set():
                    self._cancel(a)
            if not self._active:
                continue
            try:
                self.engine.step()
            except Exception as e:  # a failed step ends the jobs it ran, never the worker
                log.exception("generation failed")
                for a in list(self._active):
                    self.engine.cancel(a.req)
                    self._end(a, Finish("error", len(a.job.prompt_ids),
                                        error=f"{type(e).__name__}: {e}"), None)
                continue
            for a in list(self._active):
                self._post(a)

    def _idle(self, idle) -> None:
        try:
            idle()
        except Exception:  # the watch's failure never ends the worker
            log.exception("the idle engine's memory watch failed")

    def _start(self, job: Job) -> None:
        if job.cancelled.is_set():
            self._end(_Active(job, None, self.tokenizer), Finish("cancelled"), None)
            return
        try:
            req = self.engine.submit(job.prompt_ids, job.params, job.constraint)
        except Exception as e:  # the routes checked the budget; whatever is left ends here
            log.exception("the engine refused a request")
            self._end(_Active(job, None, self.tokenizer),
                      Finish("error", len(job.prompt_ids), error=f"{type(e).__name__}: {e}"), None)
            return
        a = _Active(job, req, self.tokenizer)
        self._active.append(a)
        with self._lock:
            self.num_running += 1
            self.running_job = job

    def _post(self, a: _Active) -> None:
        """The job's new tokens as a Piece; its Finish once the engine has ended it."""
        new = a.req.take()
        if new:
            if a.t_first is None:
                a.t_first = time.perf_counter()
                if self.metrics is not None:
                    self.metrics.ttft.observe(a.t_first - a.job.t_submit)
            logprobs = []
            for token_id in new:
                a.generated.append(token_id)
                if a.job.params.logprobs is not None:
                    logprobs.append(self._logprob(a, token_id, len(a.generated) - 1))
            piece = "".join(a.text.push(t) for t in new)
            if piece or logprobs:
                a.job.post(Piece(piece, tuple(logprobs)))
        if not a.req.finished:
            return
        st = a.req.stats
        tail = a.text.finish()
        if tail:
            a.job.post(Piece(tail))
        stop_string = _matched_stop(self.tokenizer, a.generated, a.job.params.stop) \
            if st.stop_reason == "stop" else None
        self._end(a, Finish(FINISH.get(st.stop_reason, "stop"), st.num_prompt_tokens,
                            st.cached_tokens, st.num_generated, stop_string), st)

    def _cancel(self, a: _Active) -> None:
        self.engine.cancel(a.req)
        st = a.req.stats
        self._end(a, Finish("cancelled", st.num_prompt_tokens, st.cached_tokens,
                            st.num_generated), st)

    def _end(self, a: _Active, finish: Finish, stats) -> None:
        if a in self._active:
            self._active.remove(a)
            with self._lock:
                self.num_running -= 1
        with self._lock:
            self.num_admitted -= 1
            if self.running_job is a.job:
                self.running_job = None
            self._lock.notify_all()
        if self.metrics is not None:
            self.metrics.job_done(finish, self._expert_growth(stats))
        a.job.post(finish)

    def _expert_growth(self, stats):
        """stats with its expert counters replaced by the runtime's growth since the last report
        (jobs that ran together would each count the steps they shared)."""
        if stats is None or self._experts_seen is None:
            return stats
        now = dict(self.engine.experts.stats)
        growth = {k: v - self._experts_seen.get(k, 0) for k, v in now.items()
                  if isinstance(v, (int, float))}
        self._experts_seen = now
        return dataclasses.replace(stats, experts=growth)

    def _logprob(self, a: _Active, token_id: int, i: int) -> TokenLogprob:
        """The i-th generated token's TokenLogprob from its request's stats.logprobs."""
        logprob, top = a.req.stats.logprobs[i]
        return TokenLogprob(self._text(token_id), logprob,
                            tuple((self._text(t), lp) for t, lp in top))

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _matched_stop(tokenizer, generated: list, stops) -> Optional[str]:
    """The stop string that ended the generation: the one found earliest in its text."""
    text = tokenizer.decode(generated)
    found = [(text.find(s), s) for s in stops if s in text]
    return min(found)[1] if found else None
