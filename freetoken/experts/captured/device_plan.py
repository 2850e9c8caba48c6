"""The plan of a GPU-controlled decode step's MoE layer (captured/control.py), on the device: the
cache's books mirrored on the GPU (DeviceBooks), the plan kernel, and the layer's mailbox in
pinned memory that the kernel fills for the host server (cython/serve.h).

_plan_kernel, one Triton program per layer, over the R = T*K routes of the step's T tokens:
hit/miss per distinct expert against the books (an expert several tokens route to is planned
once, by its first route); m the distinct misses, q = the split's q_of_m[m] (and b = b_of_m[m]
admissions), both clamped to the free slots; filled: the q misses with the most routes (ties:
lower expert), admitted: the next b; LRU victims by repeated argmin over the stamps (the step's
hits are touched first, so never among them); the books rewritten (hits touched in ascending
expert order, then the fills, then the admissions, in ascending expert order each, assigned
and touched); the fill and admission lists, the device routes per (token, k) (slot, weight;
CPU routes at weight 0, slot 0), the CPU's route count and the step counters; the CPU's routes
per (token, k) and the T tokens' x (fp32) straight into the mailbox. It is the host planner's
plan (plan.make_decode_plan for one token, plan.make_plan over the union for T > 1, with LRU
eviction and the split's tables), field by field: tests/test_device_step.py checks it step by
step. Example (T = 2, K = 2): routes [[5, 2], [2, 7]], 5 resident, q = 1: 2 (two routes) is
filled, 7 runs on the CPU: device routes 0, 1, 2 (two on 2's slot), CPU route 3.

Shape legend: L MoE layers, E experts per layer, C cache slots (M at most: the books' size),
T tokens, K routes per token, R = T*K routes (r = t*K + k), D hidden.
"""
import torch

from ...config import triton_interpreted
from ..transfer import zero_copy

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

COUNTERS = ("hits", "misses", "fills", "evictions", "cpu_experts", "behind", "cpu_routes",
            "device_routes")
# Routes (T tokens x K) of one step the plan kernel and the native server take (serve_impl.c
# MAX_ROUTES): the kernel compares every route with every other ([R, R] in one program) and
# unrolls its victim loop R times; 64 keeps both in registers and its compile short, and covers
# B = 8 at K = 8 (Qwen3-30B-A3B, where B = 4 already touches 29 experts a layer:
# docs/MEASUREMENTS.md#batched-decode). Larger batches are cut for the host's plan (graph_step.py).
MAX_ROUTES = 64
_NEVER = (1 << 62)  # larger than any stamp


def available() -> bool:
    return triton is not None


class DeviceBooks:
    """Device copies of the cache's books (cache.py: residency [L, E], owner [C, 2], stamps [C],
    the clock), the split's q table and the step counters. The per-slot books are sized for
    the cache's max_slots (M) once, and num_slots [1] holds the current slot count C that the
    plan kernel reads at every replay: a resize of fixed-address storage (cache.py) changes it
    with a push, and the captured steps go on. Slots [C, M) are never read by the kernel; push
    leaves them unowned and stamped NEVER."""

    def __init__(self, cache, q_of_m, device, b_of_m=None):
        self.cache, self.device = cache, device
        M = cache.max_slots
        self.res = torch.empty(cache.residency.shape, dtype=torch.int64, device=device)  # [L, E]
        self.own = torch.full((M, 2), -1, dtype=torch.int64, device=device)  # [M, 2]
        self.stamps = torch.full((M,), _NEVER, dtype=torch.int64, device=device)  # [M]
        self.num_slots = torch.zeros(1, dtype=torch.int64, device=device)  # [1] C
        self.clock = torch.zeros(1, dtype=torch.int64, device=device)
        # by distinct misses m = 0 .. R: [R + 1], the most routes a step has
        self.qtab = torch.tensor(list(q_of_m), dtype=torch.int64, device=device)
        b_of_m = [0] * len(q_of_m) if b_of_m is None else list(b_of_m)
        self.btab = torch.tensor(b_of_m, dtype=torch.int64, device=device)  # [R + 1] admissions
        self.admits = any(b_of_m)
        self.counts = torch.zeros(len(COUNTERS), dtype=torch.int64, device=device)

    def push(self) -> None:
        """Host books -> device (the device copy becomes the truth)."""
        c = self.cache
        C = c.capacity
        self.res.copy_(c.residency)
        self.own[:C].copy_(c.owner)
        self.stamps[:C].copy_(c.last_used)
        if C < self.own.shape[0]:
            self.own[C:].fill_(-1)
            self.stamps[C:].fill_(_NEVER)
        self.num_slots.fill_(C)
        self.clock.fill_(c.clock)
        self.counts.zero_()

    def pull(self) -> dict:
        """Device books -> host (after the device's work so far); returns the step counters
        since the last push or pull (COUNTERS: fills include admissions, `behind` counts those),
        added to the cache's own counters too, then zeroed."""
        c = self.cache
        C = c.capacity
        c.residency.copy_(self.res.cpu())
        c.owner.copy_(self.own[:C].cpu())
        c.last_used.copy_(self.stamps[:C].cpu())
        c.clock = int(self.clock.item())
        counts = dict(zip(COUNTERS, self.counts.tolist()))
        self.counts.zero_()
        for k in ("hits", "misses", "fills", "evictions"):
            c.stats[k] += counts[k]
        return counts


if triton is not None:
    # (do_not_specialize: a 1 would be a constant, and compile a kernel of its own)
    @triton.jit(do_not_specialize=["layer", "E", "K", "R", "CAP", "D"])
    def _plan_kernel(ids_ptr, w_ptr, x_ptr, res_ptr, own_ptr, stamps_ptr, clock_ptr, qtab_ptr,
                     btab_ptr, count_ptr, slot_ptr, wdev_ptr, fsrc_ptr, fdst_ptr, asrc_ptr,
                     adst_ptr, ncpu_ptr, seq_ptr, mb_ids_ptr, mb_w_ptr, mb_x_ptr, mb_tok_ptr,
                     mb_seq_ptr, flags_ptr, nslots_ptr, layer, E, K, R, CAP, D, BR: tl.constexpr,
                     BC: tl.constexpr, BD: tl.constexpr, NEVER: tl.constexpr,
                     RAISE: tl.constexpr, INTERPRETED: tl.constexpr):
        r = tl.arange(0, BR)  # route r = t*K + k
        rm = r < R
        e = tl.load(ids_ptr + r, mask=rm, other=0)  # [BR]
        w = tl.load(w_ptr + r, mask=rm, other=0.0)
        same = (e[:, None] == e[None, :]) & rm[:, None] & rm[None, :]  # [BR, BR] same expert
        lead = rm & (tl.sum((same & (r[None, :] < r[:, None])).to(tl.int64), axis=1) == 0)
        cnt = tl.sum(same.to(tl.int64), axis=1)  # routes of the route's expert
        base = layer.to(tl.int64) * E
        s = tl.load(res_ptr + base + e, mask=rm, other=-1)
        hit = lead & (s >= 0)  # per distinct expert: its first route stands for it
        miss = lead & (s < 0)
        less = e[None, :] < e[:, None]  # [BR, BR]: expert j sorts before expert i
        hrank = tl.sum((less & hit[None, :]).to(tl.int64), axis=1)  # rank among the hits
        # the misses in make_plan's order (most routes first, then ascending expert)
        first = (cnt[None, :] > cnt[:, None]) | ((cnt[None, :] == cnt[:, None]) & less)
        prank = tl.sum((first & miss[None, :]).to(tl.int64), axis=1)
        nh = tl.sum(hit.to(tl.int64), axis=0)
        m = tl.sum(miss.to(tl.int64), axis=0)
        C = tl.load(nslots_ptr)  # the slot count now (read at replay: a resize changes it)
        clock = tl.load(clock_ptr)
        tl.store(stamps_ptr + s, clock + 1 + hrank, mask=hit)  # hits touched, ascending expert
        clock = clock + nh
        q = tl.minimum(tl.load(qtab_ptr + m), C - nh)
        q = tl.maximum(q, 0)
        b = tl.maximum(tl.minimum(tl.load(btab_ptr + m), C - nh - q), 0)  # admissions
        fill = miss & (prank < q)
        admit = miss & (prank >= q) & (prank < q + b)
        # the victims' order: the fills in ascending expert order, then the admissions
        order = tl.where(fill, tl.sum((less & fill[None, :]).to(tl.int64), axis=1),
                         q + tl.sum((less & admit[None, :]).to(tl.int64), axis=1))
        tl.debug_barrier()
        slot = tl.where(hit, s, -1)
        fsrc = tl.full([BR], -1, tl.int64)
        fdst = tl.zeros([BR], tl.int64)
        asrc = tl.full([BR], -1, tl.int64)
        adst = tl.zeros([BR], tl.int64)
        ev = q * 0
        # the i-th of them into the LRU slot: fills first (i < q, computed on the device this
        # step), then admissions (copied in after the step's CPU job)
        for i in tl.static_range(BR):
            if i < q + b:
                best_v = tl.full([], NEVER, tl.int64)
                best_i = tl.zeros([], tl.int64)
                for c0 in range(0, C, BC):
                    c = c0 + tl.arange(0, BC)
                    st = tl.load(stamps_ptr + c, mask=c < C, other=NEVER)
                    cmin = tl.min(st, axis=0)
                    cidx = tl.argmin(st, axis=0).to(tl.int64) + c0
                    better = cmin < best_v
                    best_i = tl.where(better, cidx, best_i)
                    best_v = tl.where(better, cmin, best_v)
                mine = (fill | admit) & (order == i)
                ne = tl.sum(tl.where(mine, e, 0), axis=0)
                ol = tl.load(own_ptr + 2 * best_i)
                oe = tl.load(own_ptr + 2 * best_i + 1)
                if ol >= 0:
                    tl.store(res_ptr + ol * E + oe, -1)
                    ev += 1
                tl.store(res_ptr + base + ne, best_i)
                tl.store(own_ptr + 2 * best_i, base // E)
                tl.store(own_ptr + 2 * best_i + 1, ne)
                tl.store(stamps_ptr + best_i, clock + 1 + i)
                if i < q:
                    slot = tl.where(mine, best_i, slot)
                    fsrc = tl.where(r == i, ne, fsrc)
                    fdst = tl.where(r == i, best_i, fdst)
                else:
                    asrc = tl.where(r == i - q, ne, asrc)
                    adst = tl.where(r == i - q, best_i, adst)
                tl.debug_barrier()
        tl.store(clock_ptr, clock + q + b)
        # every route takes its expert's slot (its first route's); the CPU's: not filled
        on_dev = lead & (slot >= 0)
        rslot = tl.sum(tl.where(same & on_dev[None, :], slot[None, :], 0), axis=1)
        cpu = rm & (tl.sum((same & on_dev[None, :]).to(tl.int64), axis=1) == 0)
        ncpu = tl.sum(cpu.to(tl.int64), axis=0)
        tl.store(slot_ptr + r, tl.where(cpu, 0, rslot), mask=rm)
        tl.store(wdev_ptr + r, tl.where(cpu, 0.0, w), mask=rm)
        tl.store(fsrc_ptr + r, fsrc, mask=rm)
        tl.store(fdst_ptr + r, fdst, mask=rm)
        tl.store(asrc_ptr + r, asrc, mask=rm)
        tl.store(adst_ptr + r, adst, mask=rm)
        for r0 in range(R, CAP, BR):  # an earlier, larger step's lists end here
            rr = r0 + tl.arange(0, BR)
            tl.store(fsrc_ptr + rr, -1, mask=rr < CAP)
            tl.store(asrc_ptr + rr, -1, mask=rr < CAP)
        tl.store(ncpu_ptr, ncpu)  # the CPU's route count (the server raises done iff > 0)
        tl.store(mb_ids_ptr + r, tl.where(cpu, e, -1), mask=rm)
        tl.store(mb_w_ptr + r, w, mask=rm)
        for d0 in range(0, (R // K) * D, BD):  # the T tokens' x, [T, D]
            d = d0 + tl.arange(0, BD)
            dm = d < (R // K) * D
            tl.store(mb_x_ptr + d, tl.load(x_ptr + d, mask=dm).to(tl.float32), mask=dm)
        tl.store(mb_tok_ptr, R // K)
        seq = tl.load(seq_ptr) + 1  # the mailbox's number, its last store
        tl.store(seq_ptr, seq)
        tl.store(mb_seq_ptr, seq)
        tl.store(count_ptr + 0, tl.load(count_ptr + 0) + nh)
        tl.store(count_ptr + 1, tl.load(count_ptr + 1) + m)
        tl.store(count_ptr + 2, tl.load(count_ptr + 2) + q + b)
        tl.store(count_ptr + 3, tl.load(count_ptr + 3) + ev)
        tl.store(count_ptr + 4, tl.load(count_ptr + 4) + (m - q))
        tl.store(count_ptr + 5, tl.load(count_ptr + 5) + b)
        tl.store(count_ptr + 6, tl.load(count_ptr + 6) + ncpu)
        tl.store(count_ptr + 7, tl.load(count_ptr + 7) + (R - ncpu))
        if RAISE:  # the layer's ready, once every thread's mailbox stores are visible system-wide
            tl.debug_barrier()
            one = tl.full([1], 1, tl.int32)
            if not INTERPRETED:  # (the interpreter runs the stores in order and has no PTX)
                one = tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.b32 $0, $1;", "=r,r", [one],
                                                dtype=tl.int32, is_pure=False, pack=1)
            tl.store(flags_ptr + tl.arange(0, 1), one)


class Mailbox:
    """One layer's exchange with the host server (cython/serve.h), pinned on cuda, for steps of
    up to max_tokens tokens (R = T*K routes, route r = t*K + k): flags [ready, done] int32, ids
    int64 [R] (the CPU's experts, -1 elsewhere), w fp32 [R], x fp32 [T * D], partial fp32
    [T * D], tokens int64 [1] (the step's T), seq int64 [1] (the plan's number of it, its last
    store: the server counts a number that has not moved on as a stale read); and the layer's
    device outputs of the plan (slot, weight per route; fills, admissions; the CPU's route
    count, the plans so far). Sized for max_tokens; a step of fewer tokens uses the front."""

    def __init__(self, K: int, D: int, device, max_tokens: int = 1):
        pin = torch.device(device).type == "cuda"
        R = K * max_tokens
        if R > MAX_ROUTES:
            raise ValueError(f"a mailbox takes at most {MAX_ROUTES} routes, not {max_tokens} "
                             f"tokens of {K}")
        self.flags = torch.zeros(2, dtype=torch.int32, pin_memory=pin)
        self.ids = torch.full((R,), -1, dtype=torch.int64, pin_memory=pin)
        self.w = torch.zeros(R, dtype=torch.float32, pin_memory=pin)
        self.x = torch.zeros(max_tokens * D, dtype=torch.float32, pin_memory=pin)
        self.partial = torch.zeros(max_tokens * D, dtype=torch.float32, pin_memory=pin)
        self.tokens = torch.ones(1, dtype=torch.int64, pin_memory=pin)
        self.seq = torch.zeros(1, dtype=torch.int64, pin_memory=pin)
        self.slot_d = torch.zeros(R, dtype=torch.int64, device=device)
        self.wdev_d = torch.zeros(R, dtype=torch.float32, device=device)
        self.fsrc_d = torch.full((R,), -1, dtype=torch.int64, device=device)
        self.fdst_d = torch.zeros(R, dtype=torch.int64, device=device)
        self.asrc_d = torch.full((R,), -1, dtype=torch.int64, device=device)  # admissions
        self.adst_d = torch.zeros(R, dtype=torch.int64, device=device)
        self.ncpu_d = torch.zeros(1, dtype=torch.int64, device=device)  # the CPU's routes
        self.seq_d = torch.zeros(1, dtype=torch.int64, device=device)  # the plans so far
        self.K, self.D, self.max_tokens, self.max_routes = K, D, max_tokens, R

    @property
    def ready_addr(self) -> int:
        return self.flags.data_ptr()

    @property
    def done_addr(self) -> int:
        return self.flags.data_ptr() + 4

    def host_view(self, name):
        """A mailbox tensor as a kernel argument: mapped on cuda, the tensor itself on cpu
        (Triton's interpreter, tests)."""
        t = getattr(self, name)
        return zero_copy.MappedHost(t) if t.is_pinned() else t


def plan_layer(books: DeviceBooks, box: Mailbox, layer: int, expert_ids, weights, x,
               raise_ready: bool = False) -> None:
    """Queue the layer's plan kernel for the step's T tokens: expert_ids int64 [T*K] and
    weights fp32 [T*K] in route order, x [T*D] (compute dtype), all on the books' device, T at
    most box.max_tokens. raise_ready: the kernel itself raises the mailbox's ready as its last
    store, after a system-scope fence (handshake.py)."""
    K, D, R = box.K, box.D, expert_ids.shape[0]
    if R % K or R > box.max_routes:
        raise ValueError(f"{R} routes do not fit the layer's mailbox ({box.max_tokens} tokens "
                         f"of {K})")
    E = books.res.shape[1]
    _plan_kernel[(1,)](expert_ids, weights, x, books.res, books.own, books.stamps, books.clock,
                       books.qtab, books.btab, books.counts, box.slot_d, box.wdev_d, box.fsrc_d,
                       box.fdst_d, box.asrc_d, box.adst_d, box.ncpu_d, box.seq_d,
                       box.host_view("ids"), box.host_view("w"), box.host_view("x"),
                       box.host_view("tokens"), box.host_view("seq"), box.host_view("flags"),
                       books.num_slots, layer, E, K, R, box.max_routes, D, BR=max(2, triton.next_power_of_2(R)),
                       BC=1024, BD=1024,  # (fixed: a resized cache recompiles nothing)
                       NEVER=_NEVER, RAISE=raise_ready,
                       INTERPRETED=triton_interpreted())
