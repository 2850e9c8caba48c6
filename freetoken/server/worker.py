"""EngineWorker: the engine on its own thread behind a bounded admission count. The event loop
submits a Job and reads its events (text pieces, then one Finish) without ever blocking.

Today's engine runs one sequence at a time, so jobs run in arrival order. NOTE: this is the one
class a batched engine (issue 32) replaces: routes see only submit(), Job, Piece and Finish.
"""
import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from ..sampling import SamplingParams
from ..tokenizer import TextStream

log = logging.getLogger("freetoken.serve")

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


class EngineWorker:
    """Owns `engine` (an Engine: generate(ids, params) -> token ids, last_stats, tokenizer) and
    the one thread that calls it. submit() is safe from the event loop; close() joins the thread.
    `metrics` (or None) is told about every finished job."""

    def __init__(self, engine, max_queue: int, metrics=None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.ctx_size = engine.config.ctx_size
        self.max_queue = max_queue
        self.metrics = metrics
        self._jobs = queue.Queue()
        self._lock = threading.Condition()  # notified when a job ends
        self.num_admitted = 0  # running + waiting
        self.num_running = 0
        self.running_job: Optional[Job] = None  # the job the engine runs now
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

    def wait_idle(self, timeout_s: float) -> bool:
        """Blocks until no job is admitted (every finished one has released its KV pages);
        False when timeout_s passed first. Not for the event loop: tests and shutdown."""
        with self._lock:
            return self._lock.wait_for(lambda: self.num_admitted == 0, timeout_s)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                self.num_running += 1
                self.running_job = job
            finish, stats = Finish("cancelled"), None
            try:
                if not job.cancelled.is_set():
                    finish, stats = self._run(job), self.engine.last_stats
            except Exception as e:  # a bad request must never end the worker
                log.exception("generation failed")
                finish = Finish("error", len(job.prompt_ids), error=f"{type(e).__name__}: {e}")
            with self._lock:
                self.num_running -= 1
                self.num_admitted -= 1
                self.running_job = None
                self._lock.notify_all()
            if self.metrics is not None:
                self.metrics.job_done(finish, stats)
            job.post(finish)

    def _run(self, job: Job) -> Finish:
        params = job.params
        token_ids = self.engine.generate(job.prompt_ids, params, job.constraint) \
            if job.constraint is not None else self.engine.generate(job.prompt_ids, params)
        text = TextStream(self.tokenizer, params.stop)
        generated, t_first, logprobs = [], None, []
        try:
            for token_id in token_ids:
                if job.cancelled.is_set():
                    break
                if t_first is None:
                    t_first = time.perf_counter()
                    if self.metrics is not None:
                        self.metrics.ttft.observe(t_first - job.t_submit)
                generated.append(token_id)
                if params.logprobs is not None:
                    logprobs.append(self._logprob(token_id, len(generated) - 1))
                piece = text.push(token_id)
                if piece:
                    job.post(Piece(piece, tuple(logprobs)))
                    logprobs = []
            else:
                tail = text.finish()
                if tail or logprobs:
                    job.post(Piece(tail, tuple(logprobs)))
        finally:
            token_ids.close()  # ends the engine's generation (and fills its stats)
        st = self.engine.last_stats
        reason = "cancelled" if job.cancelled.is_set() else FINISH.get(st.stop_reason, "stop")
        stop_string = _matched_stop(self.tokenizer, generated, params.stop) \
            if st.stop_reason == "stop" else None
        return Finish(reason, st.num_prompt_tokens, st.cached_tokens,
                      st.num_generated, stop_string)

    def _logprob(self, token_id: int, i: int) -> TokenLogprob:
        """The i-th generated token's TokenLogprob from the engine's last_stats.logprobs."""
        logprob, top = self.engine.last_stats.logprobs[i]
        return TokenLogprob(self._text(token_id), logprob,
                            tuple((self._text(t), lp) for t, lp in top))

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _matched_stop(tokenizer, generated: list, stops) -> Optional[str]:
    """The stop string that ended the generation: the one found earliest in its text."""
    text = tokenizer.decode(generated)
    found = [(text.find(s), s) for s in stops if s in text]
    return min(found)[1] if found else None
