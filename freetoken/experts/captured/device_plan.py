"""The plan of a GPU-controlled decode step's MoE layer (captured/control.py), on the device: the
cache's books mirrored on the GPU (DeviceBooks), the plan kernel, and the layer's mailbox in
pinned memory that the kernel fills for the host server (cython/serve.h).

_plan_kernel, one Triton program per layer: hit/miss of the K routed experts against the books,
q = the split's q_of_m[m] (and b = b_of_m[m] admissions), both clamped to the free slots; LRU
victims by repeated argmin over the stamps; the books rewritten (hits touched in ascending
expert order, then the fills, then the admissions, assigned and touched); the fill and
admission lists, the device routes (slot, weight; CPU routes at weight 0, slot 0), the CPU's
route count and the step counters; the CPU's routes and the token's x (fp32) straight into the
mailbox. It is the host decode planner's plan (plan.make_decode_plan with LRU eviction and the
split's tables), field by field: tests/test_device_step.py checks it step by step.

Shape legend: L MoE layers, E experts per layer, C cache slots (M at most: the books' size),
K routes of the token, D hidden.
"""
import torch

from ...config import triton_interpreted
from ..transfer import zero_copy

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

COUNTERS = ("hits", "misses", "fills", "evictions", "cpu_experts", "behind")
MAX_K = 64  # routes per token the plan kernel and the native server take
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
        self.qtab = torch.tensor(list(q_of_m), dtype=torch.int64, device=device)  # [K + 1]
        b_of_m = [0] * len(q_of_m) if b_of_m is None else list(b_of_m)
        self.btab = torch.tensor(b_of_m, dtype=torch.int64, device=device)  # [K + 1] admissions
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
    @triton.jit(do_not_specialize=["layer", "E", "K", "D"])  # (a 1 would be a constant)
    def _plan_kernel(ids_ptr, w_ptr, x_ptr, res_ptr, own_ptr, stamps_ptr, clock_ptr, qtab_ptr,
                     btab_ptr, count_ptr, slot_ptr, wdev_ptr, fsrc_ptr, fdst_ptr, asrc_ptr,
                     adst_ptr, ncpu_ptr, seq_ptr, mb_ids_ptr, mb_w_ptr, mb_x_ptr, mb_seq_ptr,
                     flags_ptr, nslots_ptr, layer, E,
                     K, D, BK: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr,
                     NEVER: tl.constexpr, RAISE: tl.constexpr, INTERPRETED: tl.constexpr):
        k = tl.arange(0, BK)
        km = k < K
        e = tl.load(ids_ptr + k, mask=km, other=0)  # [BK] distinct experts
        w = tl.load(w_ptr + k, mask=km, other=0.0)
        base = layer.to(tl.int64) * E
        s = tl.load(res_ptr + base + e, mask=km, other=-1)
        hit = km & (s >= 0)
        miss = km & (s < 0)
        less = e[None, :] < e[:, None]  # [BK, BK]: expert j sorts before expert i
        hrank = tl.sum((less & hit[None, :]).to(tl.int64), axis=1)  # rank among the hits
        mrank = tl.sum((less & miss[None, :]).to(tl.int64), axis=1)  # rank among the misses
        nh = tl.sum(hit.to(tl.int64), axis=0)
        m = tl.sum(miss.to(tl.int64), axis=0)
        C = tl.load(nslots_ptr)  # the slot count now (read at replay: a resize changes it)
        clock = tl.load(clock_ptr)
        tl.store(stamps_ptr + s, clock + 1 + hrank, mask=hit)  # hits touched, ascending expert
        clock = clock + nh
        q = tl.minimum(tl.load(qtab_ptr + m), C - nh)
        q = tl.maximum(q, 0)
        b = tl.maximum(tl.minimum(tl.load(btab_ptr + m), C - nh - q), 0)  # admissions
        tl.debug_barrier()
        slot = tl.where(hit, s, -1)
        fsrc = tl.full([BK], -1, tl.int64)
        fdst = tl.zeros([BK], tl.int64)
        asrc = tl.full([BK], -1, tl.int64)
        adst = tl.zeros([BK], tl.int64)
        ev = q * 0
        # the i-th miss (ascending expert) into the LRU slot: fills first (i < q, computed on
        # the device this step), then admissions (copied in after the step's CPU job)
        for i in tl.static_range(BK):
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
                mine = miss & (mrank == i)
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
                    fsrc = tl.where(k == i, ne, fsrc)
                    fdst = tl.where(k == i, best_i, fdst)
                else:
                    asrc = tl.where(k == i - q, ne, asrc)
                    adst = tl.where(k == i - q, best_i, adst)
                tl.debug_barrier()
        tl.store(clock_ptr, clock + q + b)
        cpu = miss & (mrank >= q)
        tl.store(slot_ptr + k, tl.where(cpu, 0, slot), mask=km)
        tl.store(wdev_ptr + k, tl.where(cpu, 0.0, w), mask=km)
        tl.store(fsrc_ptr + k, fsrc, mask=km)
        tl.store(fdst_ptr + k, fdst, mask=km)
        tl.store(asrc_ptr + k, asrc, mask=km)
        tl.store(adst_ptr + k, adst, mask=km)
        tl.store(ncpu_ptr, m - q)  # the CPU's route count (the server raises done iff > 0)
        tl.store(mb_ids_ptr + k, tl.where(cpu, e, -1), mask=km)
        tl.store(mb_w_ptr + k, w, mask=km)
        for d0 in range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            tl.store(mb_x_ptr + d, tl.load(x_ptr + d, mask=d < D).to(tl.float32), mask=d < D)
        seq = tl.load(seq_ptr) + 1  # the mailbox's number, its last store
        tl.store(seq_ptr, seq)
        tl.store(mb_seq_ptr, seq)
        tl.store(count_ptr + 0, tl.load(count_ptr + 0) + nh)
        tl.store(count_ptr + 1, tl.load(count_ptr + 1) + m)
        tl.store(count_ptr + 2, tl.load(count_ptr + 2) + q + b)
        tl.store(count_ptr + 3, tl.load(count_ptr + 3) + ev)
        tl.store(count_ptr + 4, tl.load(count_ptr + 4) + (m - q))
        tl.store(count_ptr + 5, tl.load(count_ptr + 5) + b)
        if RAISE:  # the layer's ready, once every thread's mailbox stores are visible system-wide
            tl.debug_barrier()
            one = tl.full([1], 1, tl.int32)
            if not INTERPRETED:  # (the interpreter runs the stores in order and has no PTX)
                one = tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.b32 $0, $1;", "=r,r", [one],
                                                dtype=tl.int32, is_pure=False, pack=1)
            tl.store(flags_ptr + tl.arange(0, 1), one)


class Mailbox:
    """One layer's exchange with the host server (cython/serve.h), pinned on cuda: flags
    [ready, done] int32, ids int64 [K] (the CPU's experts, -1 elsewhere), w fp32 [K], x fp32
    [D], partial fp32 [D], seq int64 [1] (the plan's number of it, its last store: the server
    counts a number that has not moved on as a stale read); and the layer's device outputs of
    the plan (slot, weight, fills, admissions, the CPU's route count, the plans so far)."""

    def __init__(self, K: int, D: int, device):
        pin = torch.device(device).type == "cuda"
        self.flags = torch.zeros(2, dtype=torch.int32, pin_memory=pin)
        self.ids = torch.full((K,), -1, dtype=torch.int64, pin_memory=pin)
        self.w = torch.zeros(K, dtype=torch.float32, pin_memory=pin)
        self.x = torch.zeros(D, dtype=torch.float32, pin_memory=pin)
        self.partial = torch.zeros(D, dtype=torch.float32, pin_memory=pin)
        self.seq = torch.zeros(1, dtype=torch.int64, pin_memory=pin)
        self.slot_d = torch.zeros(K, dtype=torch.int64, device=device)
        self.wdev_d = torch.zeros(K, dtype=torch.float32, device=device)
        self.fsrc_d = torch.full((K,), -1, dtype=torch.int64, device=device)
        self.fdst_d = torch.zeros(K, dtype=torch.int64, device=device)
        self.asrc_d = torch.full((K,), -1, dtype=torch.int64, device=device)  # admissions
        self.adst_d = torch.zeros(K, dtype=torch.int64, device=device)
        self.ncpu_d = torch.zeros(1, dtype=torch.int64, device=device)  # the CPU's routes
        self.seq_d = torch.zeros(1, dtype=torch.int64, device=device)  # the plans so far
        self.K, self.D = K, D

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
    """Queue the layer's plan kernel: expert_ids int64 [K] and weights fp32 [K] of one token,
    x [D] (compute dtype), all on the books' device. raise_ready: the kernel itself raises the
    mailbox's ready as its last store, after a system-scope fence (handshake.Signals)."""
    K, D = box.K, box.D
    E = books.res.shape[1]
    _plan_kernel[(1,)](expert_ids, weights, x, books.res, books.own, books.stamps, books.clock,
                       books.qtab, books.btab, books.counts, box.slot_d, box.wdev_d, box.fsrc_d,
                       box.fdst_d, box.asrc_d, box.adst_d, box.ncpu_d, box.seq_d,
                       box.host_view("ids"), box.host_view("w"), box.host_view("x"),
                       box.host_view("seq"), box.host_view("flags"), books.num_slots,
                       layer, E, K, D, BK=max(2, triton.next_power_of_2(K)),
                       BC=1024, BD=1024,  # (fixed: a resized cache recompiles nothing)
                       NEVER=_NEVER, RAISE=raise_ready,
                       INTERPRETED=triton_interpreted())
