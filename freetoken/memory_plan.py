"""MemoryPlan: what the engine takes on its device and in host RAM, decided at load, context
first: non-expert weights, the KV pages of ctx_size x parallel, the recurrent state per
sequence, activation and stream buffers and a margin; the expert cache gets what is left.
Owns the arithmetic and the refusals (host_memory.py reads what the OS allows); allocates
nothing.

    device budget = --gpu-mem-gb (at most what is free), else the free GPU memory;
                    on cpu (the slot pool is the "device tier") --gpu-mem-gb, else the
                    available host RAM less the expert banks
    context part  = weights + kv + state + buffers + margin   (must fit: else refused)
    expert cache  = budget - context part (a whole number of slots, at most every expert),
                    or --expert-cache-gb / --expert-cache-frac (refused past the budget);
                    0 on cpu unless --gpu-mem-gb or an override asks for a tier
    host RAM      = expert banks (+ on cpu the device part) <= available (else refused);
                    no staging (banks are read straight into place, ftw/loading.py); the
                    states kept at anchors (#36) are on the device, in its state part
    pinning       = every bank on cuda (cudaHostRegister); a locked-memory limit below them
                    is said in the plan, not refused (no pageable bank path with a staged copy
                    exists: a failed registration is a ModelError with the numbers)
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch

from . import host_memory
from .anchors import SNAPSHOTS_PER_FORWARD
from .config import chunk_default
from .errors import ConfigError, ModelError
from .experts.cache import cache_capacity
from .kv_cache import PAGE_SIZE
from .state_cache import state_nbytes

GB = 1e9  # decimal gigabytes, as --expert-cache-gb and --gpu-mem-gb count them
# The margin: on cuda a fixed part for what torch's allocator does not see (the CUDA context,
# cuBLAS workspaces, Triton's modules, captured graphs' private pools) plus a share of the
# budget for allocator fragmentation; on cpu the share only. Estimates, not measured on a GPU
# yet; the buffers' estimate against a CPU run: docs/MEASUREMENTS.md#memory-plan
MARGIN_FIXED_CUDA = 0.5 * GB
MARGIN_FRAC = 0.05
# activations of one forward, per row (token) of the largest forward: its fp32 logits, this
# many hidden-wide rows (residual, norms, q/k/v/o, partials) and FFN-wide rows (gate, up, act)
HIDDEN_ROWS, FFN_ROWS = 16, 4


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per part on the device (`budget` from `budget_from`) and in host RAM. Every part
    is what the engine allocates for it (tests hold kv, state, expert_cache and weights equal
    to the tensors), except buffers and margin, which are estimates (module docstring). At run
    time the engine replaces it as the expert cache is resized and as the KV pool borrows from
    it (kv_grow.py: kv, kv_tokens, kv_lent); the total never grows past the budget."""
    device: str  # cuda | cpu
    budget: int
    budget_from: str
    weights: int  # non-expert tensors at the compute dtype (fp32 routers counted at it too)
    kv: int
    kv_tokens: int
    ctx_size: int
    parallel: int
    state: int  # (parallel + 1) sequences' recurrent state (hybrid models), else 0
    buffers: int
    margin: int
    expert_cache: int
    num_slots: int
    num_experts: int
    slot_bytes: int
    host_banks: int  # every expert, in host RAM (pinned on cuda)
    host_available: int
    host_from: str
    memlock: Optional[int]  # RLIMIT_MEMLOCK's soft limit (None: unlimited)
    kv_lent: int = 0  # of kv_tokens, those the KV pool took from the expert cache (kv_grow.py)
    slot_storage: str = ""  # cuda: how the cache's slots are kept (cache.create_slot_memory)

    @property
    def context_part(self) -> int:
        """Everything before the expert cache."""
        return self.weights + self.kv + self.state + self.buffers + self.margin

    @property
    def total(self) -> int:
        return self.context_part + self.expert_cache

    @property
    def host_need(self) -> int:
        """Host RAM the engine takes: the banks, and on cpu the device part too."""
        return self.host_banks + (self.total - self.margin if self.device == "cpu" else 0)

    @property
    def pinned(self) -> bool:
        """Whether the banks are pinned (cuda: cudaHostRegister, every bank)."""
        return self.device == "cuda"

    def lines(self) -> list:
        """The short block `run`, `chat` and `serve` print to stderr."""
        state = f", state {_gb(self.state)}" if self.state else ""
        lent = f"; {self.kv_lent} of them taken from the expert cache" if self.kv_lent else ""
        lines = [f"memory plan ({self.device}, {_gb(self.budget)} from {self.budget_from}):",
                 f"  weights {_gb(self.weights)}, KV {_gb(self.kv)} ({self.kv_tokens} tokens: "
                 f"context {self.ctx_size} x {self.parallel} sequences{lent}){state}, buffers "
                 f"{_gb(self.buffers)}, margin {_gb(self.margin)}",
                 f"  expert cache {_gb(self.expert_cache)}: {self.num_slots} of {self.num_experts}"
                 f" experts ({self.slot_bytes / 1e6:.2f} MB each); {_gb(self.budget - self.total)}"
                 " left",
                 *([f"  {self.slot_storage}"] if self.slot_storage else []),
                 f"  host: expert banks {_gb(self.host_banks)} "
                 f"{'pinned' if self.pinned else 'in RAM'}, {_gb(self.host_need)} of "
                 f"{_gb(self.host_available)} available ({self.host_from})"]
        if self.pinned and self.memlock is not None and self.memlock < self.host_banks:
            lines.append(f"  note: the locked-memory limit (ulimit -l) is {_gb(self.memlock)}, "
                         "below the banks; if pinning them fails, raise it")
        return lines


def _gb(n: int) -> str:
    return f"{n / GB:.2f} GB"


def gpu_free(device) -> int:
    """Free bytes on the cuda device now."""
    return torch.cuda.mem_get_info(torch.device(device))[0]


# ---- the plan -------------------------------------------------------------------------------

def make_memory_plan(model_config, config, file, device, dtype) -> MemoryPlan:
    """The plan for the model in `file` (an open ftw file: its tensor and bank tables) under
    EngineConfig `config` on `device` in `dtype`. Raises ModelError when the expert banks
    cannot fit in host RAM, ConfigError when the context cannot fit the device budget or an
    expert-cache override plus the rest exceeds it; each message names what to lower."""
    config = chunk_default(config, torch.device(device).type)
    device = torch.device(device)
    is_cuda = device.type == "cuda"
    size = torch.empty((), dtype=dtype).element_size()
    mc, infos = model_config, {b.layer: b for b in file.banks.values()}
    host_banks = sum(b.nbytes for b in infos.values())
    avail, host_from = host_memory.host_available()
    if host_banks > avail:
        raise ModelError(f"the model's expert banks need {_gb(host_banks)} of host RAM but "
                         f"{_gb(avail)} is available ({host_from}); close other programs, or "
                         "use a machine with more RAM or a smaller model")
    budget, budget_from = _budget(config, device, avail - host_banks)
    num_experts = sum(b.num_experts for b in infos.values())
    stride = max((b.slot_stride for b in infos.values()), default=0)
    override = config.expert_cache_gb is not None or config.expert_cache_frac is not None
    # a tier: on cuda always; on cpu when asked for (the plain CPU engine runs without one)
    tier = is_cuda or override or config.gpu_mem_gb is not None
    weights = sum(math.prod(t.shape) * size for t in file.tensors.values())
    kv_tokens = -(-config.kv_budget // PAGE_SIZE) * PAGE_SIZE  # whole pages, as the engine's
    parts, heads, dim = mc.kv_entry
    kv_per_token = mc.num_layers * parts * heads * dim * size
    kv = kv_tokens * kv_per_token
    one = state_nbytes(mc, dtype)
    # the running sequences' states, each one's page-boundary copy (scheduler.py) and the
    # engine's own; then the states kept at anchors in the prefix cache, at most their budget,
    # and those a prefill forward is taking (anchors.SNAPSHOTS_PER_FORWARD)
    state = (2 * config.parallel + 1) * one
    if one and config.state_checkpoints and config.prefix_cache:
        state += (config.state_budget if config.state_budget is not None
                  else one * config.num_default_states) + one * SNAPSHOTS_PER_FORWARD
    buffers = _buffers(mc, config, infos, size, is_cuda, tier, kv_tokens)
    margin = int((MARGIN_FIXED_CUDA if is_cuda else 0) + MARGIN_FRAC * budget)
    fixed = weights + kv + state + buffers + margin
    if fixed > budget:
        fits = max(0, budget - (fixed - kv)) // kv_per_token if kv_per_token else 0
        grow = "" if is_cuda else " and --ctx-size (the buffers grow with both)"
        lower = (f"lower --ctx-size to {fits // config.parallel} or less, or --parallel"
                 if fits // config.parallel >= PAGE_SIZE else
                 f"weights, buffers and margin alone take {_gb(fixed - kv)}: lower "
                 f"--prefill-chunk{grow}")
        raise ConfigError(
            f"the context does not fit: KV for {kv_tokens} tokens ({config.ctx_size} x "
            f"{config.parallel} sequences) takes {_gb(kv)}, with weights {_gb(weights)}, "
            f"{'state ' + _gb(state) + ', ' if state else ''}buffers {_gb(buffers)} and margin "
            f"{_gb(margin)}: {_gb(fixed)} > {_gb(budget)} ({budget_from}); {lower}"
            f"{_raise_cap(config, is_cuda)}")
    if override:
        num_slots = cache_capacity(config, infos, device)
        if fixed + num_slots * stride > budget:
            _refuse_override(config, num_slots * stride, fixed, budget, budget_from,
                             num_experts * stride, is_cuda)
    else:
        num_slots = min(num_experts, (budget - fixed) // stride) if tier and stride else 0
    return MemoryPlan(device.type, budget, budget_from, weights, kv, kv_tokens, config.ctx_size,
                      config.parallel, state, buffers, margin, num_slots * stride, num_slots,
                      num_experts, stride, host_banks, avail, host_from,
                      host_memory.read_memlock() if is_cuda else None)


def _buffers(mc, config, infos: dict, size: int, is_cuda: bool, tier: bool, kv_tokens: int) -> int:
    """Activation and stream buffers: the largest forward's rows (a prefill chunk, or the
    parallel sequences' decode step) x (HIDDEN_ROWS hidden-wide + FFN_ROWS FFN-wide rows),
    fp32 logits of the parallel sequences' rows (a prefill chunk keeps its last row's only;
    Engine.score's [chunk, V] are outside the plan), on cpu one layer's attention scores too,
    and with a tier the prefill stream's layer buffers (prefill/stream.py)."""
    rows = max(config.prefill_chunk, config.parallel)
    ffn = max(mc.intermediate_size, mc.shared_expert_intermediate_size,
              mc.moe_intermediate_size * max(1, mc.num_experts_per_tok))
    total = (config.parallel * 4 * mc.vocab_size
             + rows * (HIDDEN_ROWS * mc.hidden_size + FFN_ROWS * ffn) * size)
    if not is_cuda:  # the CPU's SDPA may build the scores: rows x heads x context fp32
        total += rows * mc.num_heads * min(config.ctx_size, kv_tokens) * 4
    if tier and config.tuning.prefill_stream is not False:
        total += config.tuning.prefill_buffers * max((b.nbytes for b in infos.values()), default=0)
    return total


def _refuse_override(config, cache: int, fixed: int, budget: int, budget_from: str,
                     all_experts: int, is_cuda: bool) -> None:
    room = max(0, budget - fixed)
    if config.expert_cache_gb is not None:
        what, most = f"--expert-cache-gb {config.expert_cache_gb:g}", f"{room / GB:.2f}"
    else:
        what, most = (f"--expert-cache-frac {config.expert_cache_frac:g}",
                      f"{room / all_experts:.3f}")
    raise ConfigError(
        f"{what} ({_gb(cache)}) plus the rest ({_gb(fixed)}: weights, KV, state, buffers, "
        f"margin) exceeds {_gb(budget)} ({budget_from}); lower {what.split()[0]} to {most} or "
        f"less, or --ctx-size / --parallel{_raise_cap(config, is_cuda)}")


def _budget(config, device, host_room: int) -> tuple:
    """(device bytes the plan fits in, where from)."""
    cap = None if config.gpu_mem_gb is None else int(config.gpu_mem_gb * GB)
    if device.type == "cuda":
        free = gpu_free(device)
        if cap is None:
            return free, "free GPU memory"
        if cap > free:
            return free, f"free GPU memory, below --gpu-mem-gb {config.gpu_mem_gb:g}"
        return cap, f"--gpu-mem-gb {config.gpu_mem_gb:g}"
    if cap is None:
        return host_room, "available host RAM less the expert banks"
    if cap > host_room:
        return host_room, (f"available host RAM less the expert banks, below --gpu-mem-gb "
                           f"{config.gpu_mem_gb:g}")
    return cap, f"--gpu-mem-gb {config.gpu_mem_gb:g} on the cpu tier"


def _raise_cap(config, is_cuda: bool) -> str:
    if config.gpu_mem_gb is not None:
        return ", or raise --gpu-mem-gb"
    return ", or free GPU memory" if is_cuda else ", or free host memory"
