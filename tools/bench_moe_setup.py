"""Shared set-up of the MoE benches (bench_decode.py, bench_prefill.py): a Qwen3-30B-A3B-shaped
model with random weights, its expert banks built in host memory (no FTW file), the real
qwen3_moe model layers on the device with routing injected from a workload trace, and the
hardware header line. Measures nothing itself; the benches time what they run.
A bench that offers --shape (bench_batch.py; parse_shape_args) runs any shape of
bench_shapes.py instead, its family's model with its random weights and banks.

Host banks: bench_host_banks.py.
"""
import os
import platform
import sys
import threading
from contextlib import contextmanager

import numpy as np
import torch

from bench_host_banks import FileBanks, HostBanks, banks_line
from freetoken import profile
from freetoken.config import ModelConfig
from freetoken.experts.bank import bank_tensor, expert_slot
from freetoken.loader import build_model, load_model
from freetoken.models import model_class

GB = 1e9
QWEN3_30B = dict(layers=48, experts=128, top_k=8, hidden=2048, inter=768, heads=32,
                 kv_heads=4, head_dim=128, vocab=151936)


def add_shape_args(ap) -> None:
    """--layers ... --vocab (defaults: Qwen3-30B-A3B), --device, --seed, --cpu-threads."""
    for name, value in QWEN3_30B.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=value,
                        help=f"model shape [{value}]")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-threads", type=int, default=None, help="CPU expert pool threads [engine default]")
    ap.add_argument("--fill-threads", type=int, default=None, help="threads filling the banks [all CPUs]")


def parse_shape_args(ap, argv=None):
    """ap.parse_args(argv) for a bench with add_shape_args and bench_shapes.add_shape_args(ap,
    shrink=False): with --shape, a.shrink gets the shape options given on the command line
    (they shrink the named shape; the others are the shape's own)."""
    a = ap.parse_args(argv)
    a.shrink = {}
    if a.shape:
        ap.set_defaults(**dict.fromkeys(QWEN3_30B))
        given = vars(ap.parse_args(argv))
        a.shrink = {k: given[k] for k in QWEN3_30B if given[k] is not None}
    return a


def shape_file(a):
    """The bench_shapes.SyntheticFile of --shape, shrunk by a.shrink (parse_shape_args)."""
    from bench_shapes import SHAPES, SyntheticFile, parse_sets
    hf = SHAPES[a.shape]
    keys = {"top_k": "num_experts_per_tok", "hidden": "hidden_size", "heads": "num_attention_heads",
            "kv_heads": "num_key_value_heads", "head_dim": "head_dim", "vocab": "vocab_size",
            "inter": "moe_intermediate_size" if "moe_intermediate_size" in hf else "intermediate_size"}
    fields = {keys[k]: v for k, v in a.shrink.items() if k in keys}
    return SyntheticFile(a.shape, a.seed, a.shrink.get("layers"), a.shrink.get("experts"), a.tiny,
                         a.fill_threads, quant=getattr(a, "quant", "bf16"),
                         **{**fields, **parse_sets(a.set)})


def model_config(a) -> ModelConfig:
    return ModelConfig(family="qwen3_moe", vocab_size=a.vocab, hidden_size=a.hidden,
                       num_layers=a.layers, num_heads=a.heads, num_kv_heads=a.kv_heads,
                       head_dim=a.head_dim, rms_norm_eps=1e-6, rope_theta=1e6,
                       max_position_embeddings=40960, num_experts=a.experts,
                       num_experts_per_tok=a.top_k, moe_intermediate_size=a.inter,
                       moe_layers=tuple(range(a.layers)), qk_norm="per_head",
                       norm_topk_prob=True, source_dtype="bf16")


# ---- the model with injected routing ---------------------------------------------------------------

class _Cursor(threading.local):
    start = cursor = 0


class InjectedRouting:
    """ExpertRuntime proxy: the model's router still runs (its cost is real), then its expert
    ids and weights are replaced by the trace's rows for the tokens of this forward. The trace
    lives on the compute device, so the runtime's host copy of the ids costs the same sync as
    with real routing. `runtime` can be swapped between forwards; `cursor` is the next token.
    start and cursor are per thread (a decode thread beside a prefill forward: bench_batch.py
    --beside-mode thread), 0 on a thread that has not set them (set_trace, moved_to)."""

    def __init__(self, runtime, moe_layers):
        self.runtime = runtime
        self.index = {layer: i for i, layer in enumerate(moe_layers)}
        self.ids = self.weights = self.cursor_h = self.cursor_d = None
        self._at = _Cursor()

    start = property(lambda self: self._at.start, lambda self, v: setattr(self._at, "start", v))
    cursor = property(lambda self: self._at.cursor, lambda self, v: setattr(self._at, "cursor", v))

    def set_trace(self, ids: torch.Tensor, weights: torch.Tensor, cursor: int = 0) -> None:
        """ids [T, L, K] int64, weights [T, L, K] fp32, both on the compute device."""
        self.ids, self.weights, self.cursor = ids, weights, cursor
        self.cursor_h = self.cursor_d = None

    def begin_step(self, phase: str, num_tokens: int) -> None:
        if self.runtime.capturing:  # the model's own call inside a captured step
            return
        self.start, self.cursor = self.cursor, self.cursor + num_tokens
        if self.cursor_h is not None and (phase == "decode" or getattr(self.runtime, "graph_safe", False)):
            # read by the captured copy at replay (a real runtime captures decode steps only: a
            # prefill forward on another thread leaves the decode thread's row alone)
            self.cursor_h[0] = self.start
        self.runtime.begin_step(phase, num_tokens)

    @property
    def capturing(self) -> bool:
        return self.runtime.capturing

    def where(self) -> tuple:
        """(start, cursor): this forward's first trace row and the next forward's, to give back
        to moved_to() after a forward run inside another (a decode step beside a prefill)."""
        return self.start, self.cursor

    def moved_to(self, where: tuple) -> None:
        self.start, self.cursor = where

    def forward(self, layer, x, expert_ids, weights):
        T = x.shape[0]
        i = self.index[layer]
        if not (self.runtime.capturing or getattr(self.runtime, "graph_safe", False)):
            return self.runtime.forward(layer, x, self.ids[self.start:self.start + T, i],
                                        self.weights[self.start:self.start + T, i])
        # a captured step (T tokens: rows cursor.. cursor + T - 1): the trace rows come from a
        # device index that a captured copy takes from pinned host memory, which begin_step
        # updates before each replay
        if self.cursor_d is None:
            self.cursor_h = torch.full((1,), self.start, dtype=torch.int64,
                                       pin_memory=x.device.type == "cuda")
            self.cursor_d = torch.zeros(1, dtype=torch.int64, device=x.device)
        if i == 0:
            self.cursor_d.copy_(self.cursor_h, non_blocking=True)
        rows = self.cursor_d + torch.arange(T, device=x.device) if T > 1 else self.cursor_d
        return self.runtime.forward(layer, x, self.ids.index_select(0, rows)[:, i],
                                    self.weights.index_select(0, rows)[:, i])

    @property
    def stats(self):
        return self.runtime.stats


class PlainResident:
    """Baseline for the machinery's cost: every expert plainly resident in VRAM, one [E, stride]
    weight tensor per layer (copied from the host banks) selected by expert id, with the same
    gathered matmuls as a captured step; no cache, no residency table, no host work. Capture
    safe as it is: the bench captures the whole step in one graph (plain_graph). act: the
    experts' kernel_args.ExpertAct (experts.ffn.check_act of the model config; the biases of a
    biased bank come with its slots)."""

    graph_safe = True  # the routing proxy takes its rows from a device index
    capturing = False  # True while plain_graph warms up and captures

    def __init__(self, hb: "HostBanks", device, act=None):
        from freetoken.experts.compute.gathered import GatheredExperts
        from freetoken.kernel_args import SILU
        infos = {layer: b.info for layer, b in hb.banks.items()}
        E, stride = next(iter(infos.values())).num_experts, hb.slot_bytes
        # one [L * E, stride] tensor, as large as the cache holding every expert: the same
        # gather kernels; only the residency lookup (layer, expert) -> slot is missing
        self.weights = torch.empty((len(infos) * E, stride), dtype=torch.uint8, device=device)
        self.first = {}
        for i, (layer, b) in enumerate(hb.banks.items()):
            self.weights[i * E:(i + 1) * E].copy_(torch.from_numpy(b.data).view(E, stride))
            self.first[layer] = i * E
        self.gathered = GatheredExperts(self.weights, infos, act or SILU)
        self.stats = {}

    def begin_step(self, phase, num_tokens):
        pass

    def forward(self, layer, x, expert_ids, weights):
        slots = expert_ids.reshape(-1) + self.first[layer]  # expert id -> row, no table
        return self.gathered.run(layer, x, slots, weights.reshape(-1).float()).to(x.dtype)

    def close(self):
        self.weights = self.gathered = None


def plain_graph(model, kv, device, runtime, state=None):
    """(step(token [1]) -> logits [1, V]) replaying the whole decode step of a model whose
    expert runtime (PlainResident, behind the model's routing proxy) needs no host, from one
    CUDA graph over the KV cache's whole span. state: the sequence's StateCache (Gated DeltaNet
    layers), handled as DecodeGraphs does: the graph advances a static copy (graphs.StaticState),
    the state is copied in when it changed since the last step and out after each replay."""
    from freetoken.graphs import StaticKV, StaticState
    ids = torch.zeros(1, dtype=torch.int64, device=device)
    pos = torch.zeros(1, dtype=torch.int64, device=device)
    static = StaticKV(kv, pos, kv.max_tokens, model.config.sliding_window)
    row = StaticState(state) if state is not None else None
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    runtime.capturing = True
    try:
        with torch.inference_mode(), torch.cuda.stream(side):
            model(ids, pos, static, 1, state=row)  # warm-up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                logits = model(ids, pos, static, 1, state=row)
    finally:
        runtime.capturing = False
    torch.cuda.synchronize(device)
    held = [None]  # the version of `state` the static row holds

    def step(token, static=static):  # the graph reads static's slot numbers: keep it alive
        ids.copy_(token.reshape(1))
        pos.fill_(kv.reserve(1))
        if row is not None and held[0] != state.version:
            row.conv.copy_(state.conv)
            row.recurrent.copy_(state.recurrent)
        model.expert_runtime.begin_step("decode", 1)
        graph.replay()
        kv.commit(1)
        if row is not None:
            state.conv.copy_(row.conv)
            state.recurrent.copy_(row.recurrent)
            state.commit(1)
            held[0] = state.version
        return logits
    return step


def build_random_model(mc: ModelConfig, proxy, device, dtype, seed=0):
    """The real qwen3_moe model (freetoken.models) with random non-expert weights: norms 1,
    embeddings std 1, other matrices std 0.02 (values only need to stay finite: routing is
    injected)."""
    with torch.device("meta"):
        meta = model_class(mc.family)(mc, proxy)
    shapes = {n: tuple(p.shape) for n, p in meta.named_parameters()}
    names = meta.canonical_names()
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, path in names.items():
        shape = shapes[path]
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            std = 1.0 if name == "token_embd.weight" else 0.02
            tensors[name] = torch.randn(shape, generator=gen, device=device, dtype=dtype) * std
    model = build_model(mc, tensors, device, dtype, proxy)
    del tensors
    return model


def bench_model(mc: ModelConfig, proxy, device, dtype, hb, seed=0):
    """build_random_model, or with --shape (hb a FileBanks) the synthetic model's own weights."""
    if isinstance(hb, FileBanks):
        return load_model(hb.file, mc, device, dtype, proxy)
    return build_random_model(mc, proxy, device, dtype, seed)


def to_device_trace(trace, device):
    return (torch.from_numpy(trace.expert_ids).to(device), torch.from_numpy(trace.weights).to(device))


# ---- bench-local cache set-up (the engine has no API for these yet) -------------------------------

def copy_resident(rt, hb: HostBanks) -> int:
    """Copy the bytes of every expert the runtime's cache books say is resident into its slot
    (after the books were set up by warm_by_replay or install_static). Returns slots copied."""
    cache, stride = rt.cache, hb.slot_bytes
    own = cache.own  # [C, (layer, expert)]
    hosts = {layer: bank_tensor(b) for layer, b in hb.banks.items()}
    copied = 0
    for s in np.flatnonzero(own[:, 0] >= 0).tolist():
        layer, e = int(own[s, 0]), int(own[s, 1])
        cache.storage[s, :stride].copy_(expert_slot(hosts[layer], hb.banks[layer].info, e),
                                        non_blocking=True)
        copied += 1
    sync(rt.device)
    return copied


def warm_by_replay(rt, ids: np.ndarray, moe_layers) -> None:
    """Set the cache books to what the runtime's own policy leaves after decoding the history
    ids [T, L, K] (plan + apply per layer step, no bytes moved, no stats counted)."""
    from freetoken.experts.plan import apply_plan, make_plan
    ids_t = torch.from_numpy(ids)
    for t in range(ids.shape[0]):
        for i, layer in enumerate(moe_layers):
            if hasattr(rt, "split"):  # the runtime's split (admissions included)
                plan = rt.plan(make_plan, layer, ids_t[t, i:i + 1])
            else:
                plan = make_plan(rt.cache, layer, ids_t[t, i:i + 1], rt.policy, rt.P, rt.C,
                                 behind=getattr(rt, "fill_behind", 0))
            apply_plan(rt.cache, plan)


def static_placement(ids: np.ndarray, moe_layers, num_experts: int, capacity: int) -> dict:
    """{layer: experts}: capacity split evenly over layers (the first layers take the
    remainder), each layer's most frequent experts in ids [T, L, K] (ties: lower id)."""
    L = len(moe_layers)
    out = {}
    for i, layer in enumerate(moe_layers):
        budget = capacity // L + (1 if i < capacity % L else 0)
        counts = np.bincount(ids[:, i].ravel(), minlength=num_experts)
        out[layer] = sorted(np.argsort(-counts, kind="stable")[:budget].tolist())
    return out


def install_static(rt, placement: dict) -> None:
    """Make `placement` {layer: experts} the cache's residents (books only; copy_resident moves
    the bytes). Run with policy 'cpu' (q = 0) the set never changes: hits on the device, every
    other expert on the CPU. A cache that holds every expert is already full (the runtime
    preloads it): static placement is then every expert resident, and nothing is assigned."""
    if rt.all_resident:
        return
    cache, slot = rt.cache, 0
    for layer, experts in placement.items():
        for e in experts:
            cache.assign(slot, layer, e)
            slot += 1
    cache.touch(list(range(slot)))


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ---- header ------------------------------------------------------------------------------------------

def hardware_line(device) -> str:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = "no GPU"
    if torch.device(device).type == "cuda":
        p = torch.cuda.get_device_properties(device)
        gpu = f"{p.name} {p.total_memory / 2**30:.0f} GiB"
    return (f"{profile.cpu_model()} ({os.cpu_count()} CPUs, {ram:.0f} GiB RAM) | {gpu} | "
            f"torch {torch.__version__} | python {platform.python_version()}")


def shape_line(a, hb: HostBanks) -> str:
    if isinstance(hb, FileBanks):
        return hb.file.describe()
    kind = "bf16" if hb.quant == "bf16" else f"bf16 experts as {hb.quant}"
    return (f"qwen3_moe-shaped {kind}, random weights: {a.layers} layers x {a.experts} experts, "
            f"top-{a.top_k}, hidden {a.hidden}, expert width {a.inter}, {a.heads}/{a.kv_heads} heads "
            f"of {a.head_dim}, vocab {a.vocab}; experts {hb.total_bytes / GB:.2f} GB "
            f"({hb.slot_bytes / 1e6:.2f} MB per expert slot)")


def dtype_for(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


@contextmanager
def bench_banks(a, name: str):
    """The benches' common start: check --device, seed, print the hardware, shape and banks
    lines, build (and on cuda pin) the host banks (in a.quant's type when given: bf16 experts
    quantized as convert --quant writes them, bench_quant_banks.py); yields (mc, hb, device,
    dtype), closes hb."""
    device, dtype = a.device, dtype_for(a.device)
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda but no CUDA GPU is visible; use --device cpu")
    torch.manual_seed(a.seed)
    print(f"# {name} | {hardware_line(device)}", flush=True)
    if getattr(a, "shape", None):
        hb = FileBanks(shape_file(a))
        mc = ModelConfig.from_dict(hb.file.config)
        # the shape's fields where the bench reads its options (traces, header lines)
        a.layers, a.experts, a.top_k = mc.num_layers, mc.num_experts, mc.num_experts_per_tok
        a.hidden, a.inter, a.vocab = mc.hidden_size, mc.moe_intermediate_size, mc.vocab_size
        a.heads, a.kv_heads, a.head_dim = mc.num_heads, mc.num_kv_heads, mc.head_dim
    else:
        mc = model_config(a)
        hb = HostBanks(mc, a.fill_threads, a.seed, getattr(a, "quant", "bf16"))
    try:
        if device == "cuda":
            hb.pin()
        print(f"# {shape_line(a, hb)}", flush=True)
        print(f"# {banks_line(hb)}", flush=True)
        yield mc, hb, device, dtype
    finally:
        hb.close()

