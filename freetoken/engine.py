"""The token loop, one sequence at a time: load an FTW model (KV page pool, host expert banks,
expert runtime, model), then generate = the longest cached prefix of the prompt (kv/), chunked
prefill of the rest + decode steps, with timing, prefix-cache and expert counters.

Owns the loop, not the math: models/ computes logits, experts/ runs the routed experts,
sampling.py picks tokens, tokenizer.py turns them into text.
"""
import os
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator, Optional

import torch

from .config import EngineConfig, ModelConfig, chunk_default
from .errors import ConfigError, ModelError
from .experts.cache import cache_capacity
from .kernel_args import DEVICE_QUANTS, KERNEL_QUANTS
from .kv_cache import SequenceKV
from .kv_grow import KVGrow
from .memory_plan import make_memory_plan
from .memory_watch import TRIGGERS, MemoryWatch, Resize, log as memory_log
from .models.linear_attention import kernel_note, warm_fla
from .recorder import RouteRecorder
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence
from .state_cache import create_state_cache
from .stats import GenerationStats, KVStats
from .tokenizer import Tokenizer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_device(name: str) -> torch.device:
    """auto -> cuda when available, else cpu; cuda without a GPU is a ConfigError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA GPU is visible to torch; use --device cpu")
    if name not in ("cuda", "cpu"):
        raise ConfigError(f"--device must be auto, cuda or cpu, not {name!r}")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto -> bf16 on cuda, fp32 on cpu."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"dtype must be auto, bf16, fp16 or fp32, not {name!r}")
    return DTYPES[name]


class PinnedBanks:
    """register(data) pins a host bank in place (cudaHostRegister) so that fills are async DMA
    copies; release() unpins them all (before the banks are freed)."""

    def __init__(self):
        self.arrays = []

    def register(self, data) -> None:
        err = torch.cuda.cudart().cudaHostRegister(data.ctypes.data, data.nbytes, 0)
        if int(err) != 0:
            from .host_memory import read_memlock
            limit = read_memlock()
            limit = "unlimited" if limit is None else f"{limit / 1e9:.2f} GB"
            pinned = sum(a.nbytes for a in self.arrays) / 1e9
            raise ModelError(f"cudaHostRegister failed ({err}) for a {data.nbytes / 1e9:.2f} GB "
                             f"expert bank after {pinned:.2f} GB pinned (locked-memory limit "
                             f"{limit}); raise the limit (ulimit -l) or free host memory")
        self.arrays.append(data)

    def release(self) -> None:
        for data in self.arrays:
            torch.cuda.cudart().cudaHostUnregister(data.ctypes.data)
        self.arrays = []


class Engine:
    """One model, its requests over a pool of KV pages (config.kv_budget tokens), up to
    config.parallel of them decoding together (scheduler.py); with config.prefix_cache,
    finished sequences' pages stay cached for later prompts. Not thread-safe: one thread
    submits and steps (generate() steps until its own request ends).

    `last_stats` describes the latest submitted generation (filled while it runs)."""

    def __init__(self, model, config: Optional[EngineConfig] = None):
        """model: an FTW file's path, or an already opened file with ftw.open's interface
        (path, config, tokenizer_json, chat_template, tensors, tensor_bytes, banks, load_banks,
        close), which the engine then owns: close() closes it."""
        t0 = time.perf_counter()
        import ftw
        from .experts import create_expert_runtime
        from .profile import expert_rates
        from .loader import load_model

        self.device = resolve_device((config or EngineConfig()).device)
        self.config = config = chunk_default(config or EngineConfig(), self.device.type)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if isinstance(model, (str, os.PathLike)):
            if not os.path.isfile(model):
                raise ModelError(f"model file not found: {model}; give a .ftw made by "
                                 "`freetoken convert`, or no MODEL for the bundled one")
            model = ftw.open(model)
        self.file = model
        self.path = model.path
        self.pinned, self.experts, self.graphs = PinnedBanks(), None, None
        try:
            _refuse_quantized(self.file, self.device)
            self.model_config = mc = ModelConfig.from_dict(self.file.config)
            refuse_on_device(mc.family, self.device)
            self.tokenizer = Tokenizer(self.file.tokenizer_json, self.file.chat_template,
                                       mc.bos_token_id, mc.eos_token_ids)
            # context first: weights, KV, state, buffers and margin, then the expert cache from
            # what is left; refuses here, before anything is allocated (memory_plan.py)
            self.memory_plan = plan = make_memory_plan(mc, config, self.file, self.device,
                                                       self.dtype)
            # the linear-attention layers' per-sequence state (None without such layers)
            self.state = create_state_cache(mc, self.device, self.dtype)
            self._make_kv_pool(mc)
            register = self.pinned.register if self.device.type == "cuda" else None
            banks = self.file.load_banks(threads=config.load_threads, register=register)
            rates = expert_rates(banks, config, self.device)  # the stored profile's, or defaults
            self.experts = create_expert_runtime(banks, mc, config, self.device, self.dtype, rates,
                                                 capacity=plan.num_slots)
            storage = getattr(self.experts, "storage_info", "")  # cuda: fixed address or not
            self.memory_plan = plan = replace(plan, slot_storage=storage)
            self.recorder = RouteRecorder(self.experts, mc) if config.trace_out else None
            self.model = load_model(self.file, mc, self.device, self.dtype,
                                    self.recorder or self.experts)
            warm_fla(mc, self.device, self.dtype)  # fla's autotuning at load, not at a request
            self.graphs, self.graphs_off = self._decode_graphs()
        except BaseException:
            self.close()
            raise
        self.eos_ids = frozenset(mc.eos_token_ids)
        # a route trace (--trace-out) records one generation: its requests run one at a time
        self.scheduler = Scheduler(self, 1 if self.recorder is not None else config.parallel)
        self.resizes = dict.fromkeys(TRIGGERS, 0)  # resizes of the expert cache by trigger
        has_cache = getattr(self.experts, "cache", None) is not None
        self.watch = (MemoryWatch(self, config.tuning.memory_watch_ms / 1e3)
                      if config.memory_watch and has_cache else None)
        self.kv_grow = KVGrow(self) if config.kv_grow and has_cache else None
        # lines for the user about how the model runs here (cli.py, serve's ready lines)
        self.notes = [n for n in (kernel_note(mc, self.device, self.dtype),) if n]
        self.load_s = time.perf_counter() - t0
        self.warm_s = 0.0  # warm_up()'s seconds
        self.last_stats = GenerationStats(load_s=self.load_s)

    def _make_kv_pool(self, mc) -> None:
        """kv_pages (the storage), kv_manager (pages of sequences, the prefix cache) and
        max_seq_tokens (one sequence's limit: ctx_size within the pool)."""
        from .kv import PagePool
        from .kv.manager import KVManager
        from .kv_cache import PAGE_SIZE, KVPages
        from .anchors import create_anchors
        budget = self.config.kv_budget
        num_pages = -(-budget // PAGE_SIZE)
        self.kv_pages = KVPages(mc, num_pages, PAGE_SIZE, self.device, self.dtype)
        # a recurrent state cannot be rebuilt from cached KV pages: models with linear-attention
        # layers take a cached prefix only up to a state kept at an anchor (anchors.py)
        self.anchors = create_anchors(self.config, self.tokenizer, self.state, PAGE_SIZE)
        prefix_cache = self.config.prefix_cache and (self.state is None or self.anchors is not None)
        self.state_budget = self._state_budget()
        self.kv_manager = KVManager(PagePool(num_pages, PAGE_SIZE), prefix_cache,
                                    needs_state=self.state is not None,
                                    state_budget=self.state_budget,
                                    copy_rows=self.kv_pages.copy_rows)
        self.max_seq_tokens = min(self.config.ctx_size, num_pages * PAGE_SIZE)
        self.kv_planned_tokens = num_pages * PAGE_SIZE  # what a request must fit (kv_grow.py)
        self.kv_stats = KVStats()

    def resize_expert_cache(self, gb: float, trigger: str = "api", reason: str = "") -> Resize:
        """Between steps (never inside one: the engine is single-threaded), the expert cache
        becomes gb decimal GB of whole slots; the memory plan follows. ConfigError when gb is
        larger than all the experts or the cache and the rest exceed the plan's budget
        (--gpu-mem-gb). On cuda the captured decode graphs stay where the slots are at a fixed
        address (ExpertRuntime.keeps_captured), else they are captured again on the next step.
        Generated tokens are unchanged by it. trigger (memory_watch.TRIGGERS) and reason go to
        the one log line of the resize; resizes asked for (not the memory watch's nor the KV
        pool's) become the size the watch grows back to; the KV pool's move that size with it."""
        assert trigger in TRIGGERS, trigger
        t0 = time.perf_counter()
        cache = getattr(self.experts, "cache", None)
        if cache is None:
            raise ConfigError("this engine runs the dense reference experts: no cache to resize")
        plan = self.memory_plan
        capacity = cache_capacity(replace(self.config, expert_cache_gb=gb, expert_cache_frac=None),
                                  self.experts.infos, self.device)
        need = plan.context_part + capacity * cache.slot_stride
        if need > plan.budget:
            rest, room = plan.context_part / 1e9, (plan.budget - plan.context_part) / 1e9
            raise ConfigError(f"an expert cache of {gb:g} GB and the rest ({rest:.2f} GB) exceed "
                              f"{plan.budget / 1e9:.2f} GB ({plan.budget_from}); use {room:.2f} "
                              "GB or less")
        # fixed-address slots (cache.py) keep the captured steps; else they read the old slots
        recapture = self.graphs is not None and not self.experts.keeps_captured(capacity)
        if recapture:
            self.graphs.release()  # dropped before the resize
        self.experts.resize_cache(capacity)
        if recapture:
            self.graphs.reset()
        self.memory_plan = replace(plan, num_slots=capacity,
                                   expert_cache=capacity * cache.slot_stride)
        self.sync()
        done = Resize(plan.num_slots, capacity, cache.slot_stride, trigger, reason,
                      time.perf_counter() - t0)
        self.resizes[trigger] += 1
        if self.watch is not None and trigger == "kv":
            self.watch.target_slots = max(0, self.watch.target_slots + capacity - plan.num_slots)
        elif self.watch is not None and trigger != "memory":
            self.watch.target_slots = capacity
        memory_log.info(done.line())
        return done

    def _state_budget(self) -> int:
        """Bytes of recurrent states the prefix cache keeps at most (0 without anchors): the
        config's, or its num_default_states states of this model. NOTE: kept on the compute
        device, beside it each running sequence's latest page-boundary state (scheduler.py)."""
        if self.anchors is None:
            return 0
        if self.config.state_budget is not None:
            return self.config.state_budget
        return self.state.nbytes * self.config.num_default_states

    def _decode_graphs(self):
        """(DecodeGraphs or None, why not or '') for the decode steps of this engine."""
        from .graphs import DecodeGraphs, unsupported_reason
        if not self.config.cuda_graphs:
            return None, "--no-cuda-graphs"
        if self.recorder is not None:
            return None, "--trace-out records routes on the host"
        why = unsupported_reason(self.model, self.experts, self.device)
        if why:
            return None, why
        return DecodeGraphs(self.model, self.kv_pages, self.max_seq_tokens, self.experts,
                            self.device, max_batch=self.config.parallel, state=self.state), ""

    def close(self) -> None:
        """Stops the expert runtime's workers and closes the model file."""
        close = getattr(self.experts, "close", None)
        if close is not None:
            close()
        self.sync()
        self.pinned.release()
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def check_prompt(self, num_tokens: int, max_new_tokens: int = 0) -> None:
        """ConfigError unless a prompt of num_tokens fits a sequence (and is not empty), and the
        prompt + max_new_tokens fit the planned KV pool (a grown one may shrink back before it
        runs): a request that can never fit is refused now."""
        if num_tokens == 0:
            raise ConfigError("the prompt is empty; give some text with -p")
        if num_tokens > self.config.ctx_size:
            raise ConfigError(f"the prompt has {num_tokens} tokens but --ctx-size is "
                              f"{self.config.ctx_size}; use --ctx-size "
                              f"{num_tokens + max_new_tokens} (prompt + -n) or a shorter prompt")
        pool_tokens = self.kv_planned_tokens
        if num_tokens + max_new_tokens > pool_tokens:
            raise ConfigError(f"the prompt ({num_tokens} tokens) + max tokens ({max_new_tokens}) "
                              f"can never fit the KV pool of {pool_tokens} tokens; use "
                              f"--kv-tokens {num_tokens + max_new_tokens} or more, or fewer "
                              "tokens (-n)")

    @torch.no_grad()
    def score(self, token_ids: list, prefix_cache: bool = False) -> torch.Tensor:
        """Teacher forcing: logits [N - C, V] fp32 for positions C..N-1 of token_ids, fed through
        chunked prefill (--prefill-chunk tokens per forward). C = 0 (a cold prefill) unless
        prefix_cache: then C = the tokens taken from the prefix cache (last_stats.cached_tokens).
        With the prefix cache on, the scored tokens' whole pages stay cached afterwards."""
        self.check_prompt(len(token_ids))
        ids = torch.tensor(list(token_ids), dtype=torch.int64, device=self.device)
        st = self.last_stats = GenerationStats(load_s=self.load_s, device=self.device.type,
                                               num_prompt_tokens=len(ids))
        with self.sequence(token_ids, prefix_cache, st) as (seq, kv):
            chunks = list(self._prefill_chunks(kv, ids[seq.num_cached_tokens:], seq=seq))
            st.num_prefill_forwards = len(chunks)
            return torch.cat(chunks)

    @contextmanager
    def sequence(self, token_ids: list, prefix_cache: bool = False,
                 stats: Optional[GenerationStats] = None):
        """(Sequence of token_ids, its SequenceKV on the engine's page pool), admitted with the
        longest cached prefix when prefix_cache (num_cached_tokens of them; feed the rest
        through the model in order, never other tokens); released at exit, its whole written
        pages left in the prefix cache when that is on. stats gets cached_tokens and the KV
        lines. engine.state (if any) starts as the state after the cached prefix."""
        seq = Sequence.from_prompt(token_ids)
        snapshot = self.kv_manager.admit(seq, use_cache=prefix_cache)
        if self.state is not None and snapshot is not None:
            self.state.restore(snapshot)
        elif self.state is not None:
            self.state.reset()
        kv = SequenceKV(self.kv_pages, seq, self.max_seq_tokens,
                        lambda n: self.kv_manager.grow(seq, n))
        if stats is not None:
            stats.cached_tokens = seq.num_cached_tokens
        try:
            yield seq, kv
        finally:
            self._release(seq, stats)

    def _release(self, seq: Sequence, stats: Optional[GenerationStats]) -> None:
        """Ends seq (its pages to the prefix cache or free) and counts it in the KV lines."""
        snapshot = self.kv_stats.request(seq.num_prompt_tokens, seq.num_cached_tokens,
                                         self.kv_manager)
        if stats is not None:
            stats.kv = snapshot
        self.kv_manager.release(seq)

    def warm_up(self) -> float:
        """cuda: compiles the Triton kernels requests would wait for, before the first one
        (warm_up.py); returns its seconds (warm_s), 0.0 elsewhere."""
        from .warm_up import warm_up
        self.warm_s = warm_up(self)
        return self.warm_s

    def generate(self, prompt_ids: list, params: Optional[SamplingParams] = None,
                 constraint=None) -> Iterator[int]:
        """Yields generated token ids (EOS is not yielded). Stops at an EOS id (unless
        params.ignore_eos: then it is yielded like any token), a stop string (the token completing
        it is yielded), params.max_tokens, or a full KV cache.
        Validates the prompt before the first next(). constraint (or None): mask(logits [V]) ->
        logits, applied before sampling, and advance(token_id) after each sampled token (a
        grammar: server/grammar.py). params.logprobs: last_stats.logprobs gets token_logprobs()
        of each sampled token, from the unmasked logits. Runs the scheduler until this request
        ends (other submitted requests advance with it); closing the iterator cancels it."""
        req = self.submit(prompt_ids, params, constraint)
        return self._drive(req)

    def submit(self, prompt_ids: list, params: Optional[SamplingParams] = None, constraint=None,
               prefix_cache: bool = True):
        """Queues a generation in the scheduler (scheduler.Request; step() runs it): checks
        first that it can ever fit. last_stats becomes its stats. The route trace
        (--trace-out) records every prompt token: nothing comes from the cache then."""
        params = params or SamplingParams()
        self.check_prompt(len(prompt_ids), params.max_tokens)
        req = self.scheduler.submit(prompt_ids, params, constraint, prefix_cache)
        self.last_stats = req.stats
        return req

    def step(self) -> None:
        """One scheduling step over every submitted request (scheduler.py)."""
        with torch.no_grad():
            self.scheduler.step()
        if self.kv_grow is not None:  # between steps: the safe point of a resize
            self.kv_grow.after_step()
        if self.watch is not None:
            self.watch.after_step()

    def idle(self) -> None:
        """Nothing to step (a server waiting for requests): the memory watch still looks, so
        that memory another program needs is given back while nothing runs."""
        if self.watch is not None:
            self.watch.after_step()

    def cancel(self, req) -> None:
        self.scheduler.cancel(req)

    def _drive(self, req) -> Iterator[int]:
        try:
            while True:
                yield from req.take()
                if req.finished:
                    return
                self.step()
        finally:
            self.scheduler.cancel(req)  # the caller stopped early (a no-op once finished)

    # ---- what the scheduler calls ---------------------------------------------------------

    def grow_kv_pool(self, num_pages: int) -> bool:
        """A waiting request lacks num_pages KV pages: True when the pool grew by at least
        that much (memory taken from the expert cache: kv_grow.py), else False (it waits)."""
        return self.kv_grow is not None and self.kv_grow.grow(num_pages)

    def sequence_kv(self, seq: Sequence) -> SequenceKV:
        """seq's view of the page pool (pages added as it grows)."""
        return SequenceKV(self.kv_pages, seq, self.max_seq_tokens,
                          lambda n: self.kv_manager.grow(seq, n))

    def new_state(self):
        """A fresh StateCache for one sequence (models with linear-attention layers), else None."""
        if self.state is None:
            return None
        return create_state_cache(self.model_config, self.device, self.dtype)

    def state_points(self, seq: Sequence, start: int) -> list:
        """Positions after start where prefilling seq's prompt keeps its state in the prefix
        cache (anchors.py; page-aligned, sorted); [] when no state is kept."""
        if self.anchors is None:
            return []
        return self.anchors.points(seq.tokens, start, seq.num_prompt_tokens)

    def save_state(self, seq: Sequence, snapshot, is_end: bool = False) -> None:
        """Keeps snapshot (a StateSnapshot of seq after its snapshot.num_tokens tokens) in the
        prefix cache; is_end: a request-end state (kv/radix.py drop_ends)."""
        self.kv_manager.save_state(seq, snapshot, is_end)

    def forward(self, kv, ids: torch.Tensor, num_logits: Optional[int] = None,
                state=None, between=None, snapshots=()) -> torch.Tensor:
        """ids [T] appended to kv's sequence -> logits [T or num_logits, V] fp32. between: the
        model's hook after each block; snapshots: StateSnapshots of state it fills
        (MoETransformer.forward)."""
        start = kv.num_tokens
        positions = torch.arange(start, start + ids.shape[0], device=self.device)
        return self.model(ids, positions, kv, num_logits, state=state, between=between,
                          snapshots=snapshots)

    def forward_packed(self, kvs: list, chunks: list, states: list, between=None,
                       snapshots=None) -> torch.Tensor:
        """One prefill forward of several sequences' chunks (chunks[b] appended to kvs[b]) ->
        logits [B, V] fp32 of each chunk's last token (MoETransformer.forward_packed)."""
        return self.model.forward_packed(chunks, kvs, states if self.state is not None else None,
                                         between=between, snapshots=snapshots)

    def decode(self, kv, token: torch.Tensor, state=None) -> torch.Tensor:
        """One decode step: token [1] -> logits [1, V] fp32 (replayed from graphs on cuda)."""
        if self.graphs is not None:
            return self.graphs.forward(token, kv, state)
        return self.forward(kv, token, state=state)

    def decode_batch(self, ids: torch.Tensor, kvs: list, states: list) -> torch.Tensor:
        """One decode step of B sequences: ids [B] -> logits [B, V] fp32 (replayed from graphs
        captured per batch size on cuda)."""
        if self.graphs is not None:
            return self.graphs.forward_batch(ids, kvs, states if self.state is not None else None)
        return self.model.forward_batch(ids, kvs, states)

    def end_request(self, req) -> None:
        """A running request ended: its pages released, its stats completed (expert counters
        over its lifetime: other requests' steps included when they ran together)."""
        st = req.stats
        self._release(req.seq, st)
        st.experts = _counter_delta(req.experts_before, self.experts.stats)
        st.split = getattr(self.experts, "split_info", None)
        if self.device.type == "cuda" and st.split is not None:
            g = self.graphs
            st.split += (f"; decode from CUDA graphs ({len(g.captured)} KV spans captured, "
                         f"{g.capture_s:.2f} s with their first steps; {g.step.describe()})"
                         if g is not None
                         else f"; decode eager ({self.graphs_off})")
        if self.recorder is not None:
            n = req.num_prompt_tokens
            self._write_trace(req.prompt_ids, req.tokens[n:n + req.num_generated].tolist(),
                              req.params)

    def _prefill_chunks(self, kv, ids: torch.Tensor, num_logits: Optional[int] = None,
                        seq: Optional[Sequence] = None):
        """Forwards ids [N] (the tokens after kv's) in chunks of --prefill-chunk tokens; yields
        each chunk's logits ([chunk, V], or only the last num_logits rows). seq (kv's, ids its
        prompt's rest): engine.state at its state points inside a chunk is kept, taken inside
        the chunk's forward (anchors.py)."""
        from .anchors import next_chunk_end
        base, chunk = kv.num_tokens, self.config.prefill_chunk
        points = self.state_points(seq, base) if seq is not None else []
        start, end = 0, ids.shape[0]
        while start < end:
            stop = next_chunk_end(base + start, base + end, chunk, points) - base
            kept = [p for p in points if p <= base + stop]
            del points[:len(kept)]
            snaps = self.state.snapshots_at(kept) if kept else []
            yield self.forward(kv, ids[start:stop], num_logits, self.state, snapshots=snaps)
            for snap in snaps:
                is_end = self.anchors.is_end(seq.tokens, snap.num_tokens, seq.num_prompt_tokens)
                self.save_state(seq, snap, is_end)
            start = stop

    def _write_trace(self, prompt_ids: list, generated: list, params: SamplingParams) -> None:
        """--trace-out: the routes of this generation (the file holds the latest generation)."""
        mc = self.model_config
        meta = {"family": mc.family, "num_layers": mc.num_layers, "moe_layers": list(mc.moe_layers),
                "num_experts": mc.num_experts, "top_k": mc.num_experts_per_tok,
                "model": os.path.basename(self.path), "prompt_token_ids": prompt_ids,
                "num_prompt_tokens": len(prompt_ids), "generated_token_ids": generated,
                "prompt": self.tokenizer.decode(prompt_ids, skip_special_tokens=False),
                "policy": self.config.policy, "temperature": params.temperature,
                "seed": params.seed}
        self.recorder.write(self.config.trace_out, meta)

    def count_token(self, st: GenerationStats) -> None:
        now = time.perf_counter()
        if st.num_generated == 0:
            st.ttft_s = now - st.t_start
        else:
            st.num_decoded += 1
            st.decode_s = now - st.t_start - st.ttft_s
        st.num_generated += 1

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# families whose path on a device does not equal transformers yet: refused there, not run wrong
UNVERIFIED_ON: dict = {}  # (family, device type) -> why; empty: every family runs everywhere


def refuse_on_device(family: str, device) -> None:
    """ConfigError for a family whose path on `device` is not verified (UNVERIFIED_ON)."""
    why = UNVERIFIED_ON.get((family, torch.device(device).type))
    if why:
        raise ConfigError(f"{family} runs on --device cpu only for now: {why}; use --device cpu")


def _refuse_quantized(file, device) -> None:
    """ModelError for an FTW file with quantized weights (SPEC.md §9) where no path runs them
    yet (TODO(#35)): what runs is kernels.KERNEL_QUANTS routed experts (the CPU kernels read
    their blocks, and on cuda the Triton kernels of experts/compute too: a type runs on cuda
    when both read it, DEVICE_QUANTS, since the CPU runs the misses); quantized dense tensors
    and other types do not."""
    name = os.path.basename(file.path)
    dense = sorted({t.quant for t in file.tensors.values() if t.quant != "none"})
    if dense:
        raise ModelError(f"{name} holds {', '.join(dense)} dense (non-expert) tensors; this version "
                         "of freetoken runs quantized routed experts only: convert with --quant, "
                         "which quantizes the experts alone")
    quants = sorted({b.quant for b in file.banks.values() if b.quant != "none"})
    if not quants:
        return
    kind = torch.device(device).type
    runs = [q for q in KERNEL_QUANTS if kind == "cpu" or q in DEVICE_QUANTS]
    other = [q for q in quants if q not in runs]
    if other:
        raise ModelError(f"{name} holds {', '.join(other)} experts; this version of freetoken runs "
                         f"{', '.join(runs)} experts on --device {kind}: convert with "
                         f"--quant {' or '.join(runs)}, or without --quant")
    biased = kind != "cpu" and any(
        b.quant != "none" and {p.name for p in b.projections} - {"gate", "up", "down"}
        for b in file.banks.values())
    if biased:  # gpt-oss's MXFP4 experts: the device kernels do not read a quantized bank's biases
        raise ModelError(f"{name} holds quantized experts with biases, which run on --device cpu "
                         "only so far: use --device cpu, or convert the bf16 checkpoint without "
                         "--quant for the GPU")


def _counter_delta(before: dict, after: dict) -> dict:
    """after - before for numeric counters; other values as they are now."""
    out = {}
    for k, v in after.items():
        b = before.get(k)
        numeric = isinstance(v, (int, float)) and not isinstance(v, bool)
        out[k] = v - b if numeric and isinstance(b, (int, float)) else v
    return out
