# cython: language_level=3, boundscheck=False, wraparound=False
"""The decode step's plan of one MoE layer, natively (freetoken._plan).

Private: only freetoken/experts/plan.py imports this module. decode_plan computes what
plan.make_decode_plan's Python body computes, for one token of K distinct experts under the
default LRU eviction, in one pass over the cache's books and without mutating them. Whatever it
is not sure to reproduce exactly (other dtypes or shapes, repeated or out-of-range expert ids, an
unknown policy, a split that Python would fail on) it answers with None, and the Python body
decides (or raises) instead.

Shape legend: K routes of the token, L layers, E experts per layer, C cache slots.
"""
from libc.math cimport floor, isfinite
from libc.stdint cimport int64_t
cimport numpy as cnp

cnp.import_array()

cdef enum:
    MAX_K = 256  # more routes per token: the Python body plans them


cdef inline bint _books(object a, int ndim):
    """a is an aligned, C-contiguous, native-order int64 ndarray of `ndim` dimensions."""
    if not cnp.PyArray_Check(a):
        return False
    cdef cnp.ndarray arr = <cnp.ndarray>a
    return (cnp.PyArray_TYPE(arr) == cnp.NPY_INT64 and cnp.PyArray_NDIM(arr) == ndim
            and cnp.PyArray_ISCARRAY_RO(arr))


cdef inline bint _as_double(object x, double *out):
    """A Python float, or an int small enough that double arithmetic on it is exact (then m * x
    and x + y in doubles equal Python's int arithmetic followed by its true division)."""
    if isinstance(x, float):
        out[0] = <double>x
        return True
    if type(x) is int and -(1 << 40) < x < (1 << 40):
        out[0] = <double><int64_t>x
        return True
    return False


def decode_plan(object res, object own, object stamps, object expert_ids, Py_ssize_t layer,
                object policy, object P, object C, Py_ssize_t capacity, object behind,
                object tables=None):
    """res int64 [L, E] (slot or -1), own int64 [C, 2], stamps int64 [C] (unique), expert_ids
    int64 [1, K] of distinct experts. tables: None, or (q_of_m, b_of_m) from split.MissSplit
    (tuples of K + 1 ints): then q = q_of_m[m] and b = b_of_m[m] in any step, both clamped to
    the free slots, instead of policy / P / C / behind. Returns (experts, expert_slot, hits,
    fills, cpu_experts, m, q, behind_fills, token_ids, route_ids, route_slot) as plan.MoEPlan
    holds them (the last three int64 numpy arrays [K]), or None where the Python planner must
    decide."""
    cdef int pol
    if type(behind) is not int or not -(1 << 40) < behind < (1 << 40):
        return None
    if policy == "hybrid":
        pol = 0
    elif policy == "offload":
        pol = 1
    elif policy == "cpu":
        pol = 2
    else:
        return None
    if not (_books(res, 2) and _books(own, 2) and _books(stamps, 1) and _books(expert_ids, 2)):
        return None
    cdef cnp.ndarray res_a = <cnp.ndarray>res, own_a = <cnp.ndarray>own
    cdef cnp.ndarray st_a = <cnp.ndarray>stamps, ids_a = <cnp.ndarray>expert_ids
    cdef Py_ssize_t L = cnp.PyArray_DIMS(res_a)[0], E = cnp.PyArray_DIMS(res_a)[1]
    cdef Py_ssize_t nslots = cnp.PyArray_DIMS(st_a)[0]
    cdef Py_ssize_t K = cnp.PyArray_DIMS(ids_a)[1]
    if (cnp.PyArray_DIMS(ids_a)[0] != 1 or K > MAX_K or not 0 <= layer < L
            or cnp.PyArray_DIMS(own_a)[0] != nslots or cnp.PyArray_DIMS(own_a)[1] != 2):
        return None
    cdef const int64_t *ids = <const int64_t *>cnp.PyArray_DATA(ids_a)
    cdef const int64_t *row = <const int64_t *>cnp.PyArray_DATA(res_a) + layer * E  # [E]
    cdef const int64_t *st = <const int64_t *>cnp.PyArray_DATA(st_a)  # [C]
    cdef const int64_t *ow = <const int64_t *>cnp.PyArray_DATA(own_a)  # [C, 2]

    # experts ascending (insertion sort: K is small), with the route each came from
    cdef int64_t experts[MAX_K]
    cdef int64_t order[MAX_K]  # route id of the j-th expert
    cdef int64_t slot[MAX_K]  # expert_slot, grouped order
    cdef int64_t hit_slot[MAX_K]
    cdef int64_t miss_at[MAX_K]
    cdef Py_ssize_t i, j, r
    cdef int64_t e
    for r in range(K):
        e = ids[r]
        if e < 0 or e >= E:
            return None  # the Python planner raises (or wraps negative ids, as numpy does)
        j = r
        while j > 0 and experts[j - 1] > e:
            experts[j] = experts[j - 1]
            order[j] = order[j - 1]
            j -= 1
        if j > 0 and experts[j - 1] == e:
            return None  # repeated expert: make_plan groups it
        experts[j] = e
        order[j] = r
    cdef Py_ssize_t nh = 0, m = 0
    for j in range(K):
        slot[j] = row[experts[j]]
        if slot[j] >= 0:
            hit_slot[nh] = slot[j]
            nh += 1
        else:
            miss_at[m] = j
            m += 1

    # q as policy.split: rounding halves up, clamped to [0, m] and to the free slots; or from
    # the tables
    cdef Py_ssize_t q, b, n, h
    cdef double p, c, x
    cdef Py_ssize_t free_slots = capacity - nh
    if free_slots < 0:
        free_slots = 0
    if tables is not None:
        if not (type(tables) is tuple and len(tables) == 2):
            return None
        qt, bt = tables
        if not (type(qt) is tuple and type(bt) is tuple and len(qt) == K + 1 and len(bt) == K + 1):
            return None
        qo, bo = qt[m], bt[m]
        if type(qo) is not int or type(bo) is not int or not 0 <= qo <= m or not 0 <= bo <= m - qo:
            return None
        q = min(<Py_ssize_t>qo, free_slots)
        b = min(<Py_ssize_t>bo, free_slots - q)
    else:
        if pol == 0:
            if not (_as_double(P, &p) and _as_double(C, &c)):
                return None
            q = 0
            if p + c > 0:
                x = floor(<double>m * p / (p + c) + 0.5)
                if not isfinite(x):
                    return None  # math.floor raises on it: let the Python planner say so
                q = m if x >= m else (0 if x <= 0 else <Py_ssize_t>x)
        elif pol == 1:
            q = m
        else:
            q = 0
        if q > free_slots:
            q = free_slots
        b = 0
        if q == 0:
            b = min(<Py_ssize_t>behind, m, free_slots)
    n = q + b
    if n > 0:
        if n > nslots - nh:
            return None  # LRUPolicy.victims raises
        for h in range(nh):
            if hit_slot[h] >= nslots:
                return None  # books out of shape: numpy raises on them

    # LRU victims: the n + nh lowest (stamp, slot) in one pass, then the first n that are not
    # hits (a hit may be among the lowest; at most nh are skipped)
    cdef int64_t buf_s[2 * MAX_K]
    cdef int64_t buf_i[2 * MAX_K]
    cdef int64_t victim[MAX_K]
    cdef Py_ssize_t W = n + nh, nb = 0
    cdef int64_t s
    cdef bint is_hit
    if n > 0:
        if W > nslots:
            W = nslots
        for i in range(nslots):
            s = st[i]
            if nb == W:
                if s >= buf_s[nb - 1]:
                    continue
                j = nb - 1  # drop the largest
            else:
                j = nb
                nb += 1
            while j > 0 and buf_s[j - 1] > s:  # ties: the lower slot first, as argmin
                buf_s[j] = buf_s[j - 1]
                buf_i[j] = buf_i[j - 1]
                j -= 1
            buf_s[j] = s
            buf_i[j] = i
        j = 0
        for i in range(nb):
            if j == n:
                break
            is_hit = False
            for h in range(nh):
                if hit_slot[h] == buf_i[i]:
                    is_hit = True
                    break
            if not is_hit:
                victim[j] = buf_i[i]
                j += 1

    # Python objects, in make_decode_plan's order
    cdef list experts_l = [experts[j] for j in range(K)]
    cdef list hits = [(experts[j], slot[j]) for j in range(K) if slot[j] >= 0]
    cdef list fills = [], behind_l = [], cpu = []
    for i in range(q):
        j = miss_at[i]
        fills.append((experts[j], victim[i], ow[2 * victim[i]], ow[2 * victim[i] + 1]))
        slot[j] = victim[i]
    for i in range(q, n):
        j = miss_at[i]
        behind_l.append((experts[j], victim[i], ow[2 * victim[i]], ow[2 * victim[i] + 1]))
    for i in range(q, m):
        cpu.append(experts[miss_at[i]])
    cdef list slot_l = [slot[j] for j in range(K)]
    cdef cnp.npy_intp dims[1]
    dims[0] = K
    token_ids = cnp.PyArray_ZEROS(1, dims, cnp.NPY_INT64, 0)
    route_ids = cnp.PyArray_EMPTY(1, dims, cnp.NPY_INT64, 0)
    route_slot = cnp.PyArray_EMPTY(1, dims, cnp.NPY_INT64, 0)
    cdef int64_t *rid = <int64_t *>cnp.PyArray_DATA(<cnp.ndarray>route_ids)  # [K] grouped order
    cdef int64_t *rsl = <int64_t *>cnp.PyArray_DATA(<cnp.ndarray>route_slot)  # [K] route order
    for j in range(K):
        rid[j] = order[j]
        rsl[order[j]] = slot[j]
    return (experts_l, slot_l, hits, fills, cpu, m, q, behind_l, token_ids, route_ids,
            route_slot)
