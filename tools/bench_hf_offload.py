"""Naive peer of the decode bench: HF transformers' Qwen3MoeForCausalLM (Qwen3-30B-A3B shape, random
weights, fewer layers: host RAM cannot hold a second 58 GB copy beside our banks) placed by accelerate
under the VRAM cap of bench_decode's expert cache; offloaded modules stay in host RAM and accelerate's
hooks copy them to the GPU on every forward. One table: ms/token and ms/layer (compare per layer).

VRAM cap = non-expert bytes + F x all expert bytes + 1% of the expert bytes (F = --cache-frac).
accelerate keeps room on the GPU for the largest offloaded block (it is onloaded there to run); that
reserve is added to max_memory[0] so the resident share stays F (with 48 layers it is 1/48 of them).
Splits (--split; transformers 5 qwen3_moe: a layer's 128 experts are ONE module, Qwen3MoeExperts,
two fused Parameters [E, 2I, D] and [E, D, I], so no single expert can be placed alone):
  layer    decoder layers are the blocks (the model's _no_split_modules); embeddings, final norm,
           lm_head on the GPU
  experts  a layer's fused experts module is the block; everything else on the GPU
  auto     exactly infer_auto_device_map(model, max_memory={0: cap, 'cpu': ...}) on the whole model,
           as from_pretrained(device_map='auto', max_memory=...) (lm_head usually lands offloaded)
--device cpu: the GPU side is the CPU and offloaded blocks go to 'disk' (a temporary folder:
accelerate's only offload target when the main device is the CPU), so the same hooks run.

    python tools/bench_hf_offload.py --layers 4 --cache-frac 0.25 --tokens 8
    python tools/bench_hf_offload.py --device cpu --layers 2 --hidden 64 --inter 32 --experts 8 \
        --top-k 2 --heads 4 --kv-heads 2 --head-dim 16 --vocab 128 --tokens 2
"""
import argparse
import inspect
import logging
import os
import re
import sys
import tempfile
import time

import torch
from torch import nn

import bench_moe_setup as setup

GB = 1e9
HEADER = (f"{'layers':>6} {'split':<7} {'cache':>6} {'GPU GB':>8} {'CPU GB':>8} {'ms/token':>10} "
          f"{'ms/layer':>9} {'tok/s':>8}")


class BenchError(Exception):
    """A problem the user can fix (arguments, missing package, memory); printed as one line."""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, value in {**setup.QWEN3_30B, "layers": 4}.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=value, help=f"model shape [{value}]")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cache-frac", type=float, default=0.25, help="VRAM for experts, fraction of all [0.25]")
    ap.add_argument("--split", choices=("layer", "experts", "auto"), default="layer")
    ap.add_argument("--tokens", type=int, default=8, help="timed decode tokens [8]")
    ap.add_argument("--warmup", type=int, default=2, help="decode tokens before timing [2]")
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens (prefill, not timed) [8]")
    ap.add_argument("--pin", action="store_true",
                    help="pin the offloaded host copies (accelerate never pins them; default pageable)")
    ap.add_argument("--experts-impl", default=None, help="transformers experts_implementation [its default]")
    ap.add_argument("--compare-ms-per-layer", type=float, default=None,
                    help="our engine's ms/layer (bench_decode ms/token / layers): prints HF / ours")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if not 0.0 <= a.cache_frac <= 1.0:
        raise BenchError(f"--cache-frac {a.cache_frac} is outside [0, 1]; give a fraction of all experts")
    if min(a.layers, a.tokens, a.prompt, a.experts, a.top_k) < 1 or a.warmup < 0 or a.top_k > a.experts:
        raise BenchError("--layers, --tokens, --prompt, --experts, --top-k must be >= 1 (top-k <= experts)")
    return a


def build_meta_model(a, dtype):
    """The HF model on the meta device (no init cost); experts/attention implementations chosen."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    kw = {"experts_implementation": a.experts_impl} if a.experts_impl else {}
    cfg = Qwen3MoeConfig(vocab_size=a.vocab, hidden_size=a.hidden, moe_intermediate_size=a.inter,
                         num_experts=a.experts, num_experts_per_tok=a.top_k, num_hidden_layers=a.layers,
                         num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
                         norm_topk_prob=True, tie_word_embeddings=False, decoder_sparse_step=1,
                         mlp_only_layers=[], rms_norm_eps=1e-6, **kw)
    with torch.device("meta"):
        return Qwen3MoeForCausalLM(cfg).to(dtype)


def nbytes(module_or_params) -> int:
    params = module_or_params.parameters() if isinstance(module_or_params, nn.Module) else module_or_params
    return sum(p.numel() * p.element_size() for p in params)


def layer_modules_line(model) -> str:
    """What a decoder layer is made of (read from the model, not assumed)."""
    layer = model.model.layers[0]
    parts = []
    for name, child in layer.named_children():
        inner = ", ".join(f"{n} {type(m).__name__}" + "".join(f" {p}{list(t.shape)}" for p, t in
                                                              m.named_parameters(recurse=False))
                          for n, m in child.named_children() if n in ("gate", "experts"))
        parts.append(f"{name} {type(child).__name__}" + (f" ({inner})" if inner else ""))
    return f"decoder layer: {'; '.join(parts)}; _no_split_modules {model._no_split_modules}"


def fixed_entries(module, prefix, blocks) -> dict:
    """Map every module outside `blocks` (names) to the GPU side (0): whole subtrees where no
    block lies below, descending where one does."""
    out = {}
    for name, child in module.named_children():
        full = prefix + name
        if full in blocks:
            continue
        if any(b.startswith(full + ".") for b in blocks):
            out.update(fixed_entries(child, full + ".", blocks))
        else:
            out[full] = 0
    for name, _ in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
        out[prefix + name] = 0
    return out


def plan_device_map(model, split, cap, cpu_bytes):
    """{module name: 0 (GPU side) or 'cpu' (offloaded)} from accelerate; (map, reserve bytes)."""
    from accelerate import infer_auto_device_map
    layers = model.model.layers
    if split == "auto":
        dm = infer_auto_device_map(model, max_memory={0: cap, "cpu": cpu_bytes},
                                   no_split_module_classes=model._no_split_modules)
        return dict(dm), 0
    if split == "layer":
        names, blocks = [f"model.layers.{i}" for i in range(len(layers))], list(layers)
    else:
        names = [f"model.layers.{i}.mlp.experts" for i in range(len(layers))]
        blocks = [layer.mlp.experts for layer in layers]
    dm = fixed_entries(model, "", set(names))
    budget = cap - sum(nbytes(m) for n, m in model.named_modules() if n in dm)
    if budget < 0:
        raise BenchError(f"the VRAM cap {cap / GB:.2f} GB is below the bytes that stay on the GPU with "
                         f"--split {split}; raise --cache-frac or use --split layer")
    reserve = max(nbytes(b) for b in blocks)
    placed = infer_auto_device_map(nn.ModuleList(blocks), max_memory={0: budget + reserve, "cpu": cpu_bytes},
                                   no_split_module_classes=[type(blocks[0]).__name__], clean_result=False)
    # accelerate reserves nothing while placing the last block: with the reserve added back,
    # N-1 blocks within the budget would let the last one in too; it stays offloaded
    last = str(len(blocks) - 1)
    if set(placed.values()) == {0} and sum(nbytes(b) for b in blocks) > budget and last in placed:
        placed[last] = "cpu"
    for key, dev in placed.items():
        idx, _, rest = key.partition(".")
        dm[names[int(idx)] + ("." + rest if rest else "")] = dev
    return dm, reserve


def side_of(name, dm):
    """The device-map entry covering parameter `name` (longest prefix), or None."""
    best = None
    for key in dm:
        if (key == "" or name == key or name.startswith(key + ".")) and (best is None or len(key) > len(best)):
            best = key
    return None if best is None else dm[best]


def map_summary(dm) -> dict:
    """{side: 'layers[0-1], lm_head, ...'} with layer numbers folded into ranges."""
    groups = {}
    for key, dev in dm.items():
        m = re.match(r"model\.layers\.(\d+)(.*)", key)
        pat, idx = (f"layers[{{}}]{m.group(2)}", int(m.group(1))) if m else (key.replace("model.", ""), None)
        groups.setdefault("GPU" if dev == 0 else str(dev).upper(), {}).setdefault(pat, []).append(idx)
    out = {}
    for side, pats in groups.items():
        items = []
        for pat, idx in pats.items():
            if idx[0] is None:
                items.append(pat or "everything")
                continue
            idx, runs = sorted(idx), []
            for i in idx:
                if runs and i == runs[-1][1] + 1:
                    runs[-1][1] = i
                else:
                    runs.append([i, i])
            items.append(pat.format(",".join(f"{s}" if s == e else f"{s}-{e}" for s, e in runs)))
        out[side] = ", ".join(items)
    return out


def materialize(model, dm, device, dtype, seed, pin):
    """Random weights where the map puts them (std 0.02, norms 1), made on the compute device
    (fast) and copied to host RAM for offloaded modules; the rotary buffers rebuilt."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in list(model.named_parameters()):
        mod_name, _, leaf = name.rpartition(".")
        t = (torch.ones(p.shape, dtype=dtype, device=device) if p.dim() == 1 else
             torch.randn(p.shape, generator=gen, dtype=dtype, device=device).mul_(0.02))
        if side_of(name, dm) != 0 and device != "cpu":
            host = torch.empty(p.shape, dtype=dtype, pin_memory=pin)
            t = host.copy_(t)
        model.get_submodule(mod_name)._parameters[leaf] = nn.Parameter(t, requires_grad=False)
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=model.config).to(device)


def cache_kwarg(model) -> str:
    """transformers 5.24 names the KV cache argument `cache` (past_key_values deprecated), 5.17
    `past_key_values`."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


class RouteRecorder:
    """Forward hooks on each layer's router keep the chosen expert ids (on device: no sync)."""

    def __init__(self, model):
        self.ids, self.on = {}, False
        for i, layer in enumerate(model.model.layers):
            layer.mlp.gate.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def hook(module, args, output):
            if self.on and isinstance(output, tuple):
                self.ids.setdefault(i, []).append(output[-1].detach().clone())
        return hook

    def distinct(self):
        return [len(torch.cat(v).flatten().unique()) for _, v in sorted(self.ids.items())]


@torch.inference_mode()
def decode(model, a, device, recorder):
    """Prefill the prompt, a.warmup untimed greedy tokens, a.tokens timed ones: s per token."""
    from transformers import DynamicCache
    kw = {cache_kwarg(model): DynamicCache(config=model.config), "use_cache": True}
    gen = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(0, a.vocab, (1, a.prompt), generator=gen).to(device)
    for i in range(a.warmup + a.tokens + 1):
        if i == a.warmup + 1:
            setup.sync(device)
            recorder.on, t0 = True, time.perf_counter()
        ids = model(input_ids=ids, **kw).logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        int(ids)  # one host sync per token, as the engine's sampler
    setup.sync(device)
    return (time.perf_counter() - t0) / a.tokens


def host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            return int(next(line for line in f if line.startswith("MemAvailable")).split()[1]) * 1024
    except (OSError, StopIteration):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def run(a):
    try:
        import accelerate
        import transformers
        from accelerate import dispatch_model
    except ImportError as e:
        raise BenchError(f"{e.name} is not installed; pip install accelerate==1.15.0 transformers") from None
    device = a.device
    if device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda but no CUDA GPU is visible; use --device cpu")
    if device == "cpu":
        logging.getLogger("accelerate").setLevel(logging.ERROR)  # "device 0 not available": planned only
    dtype = setup.dtype_for(device)
    torch.manual_seed(a.seed)
    print(f"# bench_hf_offload | {setup.hardware_line(device)}", flush=True)
    try:
        model = build_meta_model(a, dtype)
    except ValueError as e:  # e.g. an --experts-impl transformers does not know
        raise BenchError(str(e).splitlines()[0]) from None
    expert_b = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".mlp.experts." in n)
    non_expert_b = nbytes(model) - expert_b
    cap = int(non_expert_b + a.cache_frac * expert_b + 0.01 * expert_b)
    print(f"# transformers {transformers.__version__}, accelerate {accelerate.__version__}; "
          f"{type(model).__name__} {a.layers} layers x {a.experts} experts, top-{a.top_k}, hidden {a.hidden}, "
          f"expert width {a.inter}, {a.heads}/{a.kv_heads} heads of {a.head_dim}, vocab {a.vocab}, "
          f"{str(dtype).replace('torch.', '')}, random weights; experts_implementation "
          f"{model.config._experts_implementation}, attention {model.config._attn_implementation}")
    print(f"# {layer_modules_line(model)}")
    cpu_bytes = int(host_available() - 2 * GB) if device == "cuda" else max(int(host_available()), 1)
    dm, reserve = plan_device_map(model, a.split, cap, cpu_bytes)
    missing = [n for n, _ in model.named_parameters() if side_of(n, dm) is None]
    if missing or "disk" in dm.values():
        raise BenchError(f"accelerate could not place {missing[:3] or 'every block in host RAM'}; "
                         f"use fewer --layers")
    gpu_b = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if side_of(n, dm) == 0)
    off_b = nbytes(model) - gpu_b
    print(f"# VRAM cap {cap / GB:.4g} GB = non-expert {non_expert_b / GB:.4g} + {a.cache_frac:g} x experts "
          f"{expert_b / GB:.4g} + 1% margin; max_memory[0] for the blocks adds accelerate's onload reserve "
          f"{reserve / GB:.4g} GB (the largest block)")
    for side, what in map_summary(dm).items():
        print(f"# device map ({a.split}) {side}: {what}")
    where = ("host RAM" + (" (pinned)" if a.pin else " (pageable)") + ", copied to the GPU"
             if device == "cuda" else "a temporary folder ('disk'), read into the CPU")
    print(f"# GPU side {gpu_b / GB:.4g} GB resident; offloaded {off_b / GB:.4g} GB in {where} on every forward")
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        if free < gpu_b + reserve + GB:
            raise BenchError(f"the GPU has {free / GB:.1f} GB free, the plan needs {(gpu_b + reserve) / GB:.1f} GB")
    materialize(model, dm, device, dtype, a.seed, a.pin)
    recorder = RouteRecorder(model)
    with tempfile.TemporaryDirectory(prefix="hf_offload_") as tmp:
        if device == "cpu":  # no GPU: the GPU side runs on the CPU, offloaded blocks from 'disk'
            run_map, main = {k: "cpu" if v == 0 else "disk" for k, v in dm.items()}, "cpu"
        else:
            run_map, main = dm, 0
        dispatch_model(model, run_map, main_device=main, offload_dir=tmp, skip_keys=[cache_kwarg(model)],
                       force_hooks=True)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        s = decode(model, a, device, recorder)
    print(f"# greedy decode: {a.prompt}-token prompt + {a.warmup} warm-up tokens (excluded) + {a.tokens} "
          f"timed, HF DynamicCache; seed {a.seed}")
    print(f"# distinct experts per layer over the {a.tokens} timed tokens (of {a.experts}, top-{a.top_k}; "
          f"random routing): {recorder.distinct()}")
    ms_layer = s * 1e3 / a.layers
    print()
    print(HEADER)
    print("-" * len(HEADER))
    print(f"{a.layers:>6} {a.split:<7} {a.cache_frac:>6.0%} {gpu_b / GB:>8.4g} {off_b / GB:>8.4g} "
          f"{s * 1e3:>10.2f} {ms_layer:>9.3f} {1 / s:>8.3f}")
    peak = f"; peak GPU allocated {torch.cuda.max_memory_allocated() / GB:.2f} GB" if device == "cuda" else ""
    print(f"# per token: {off_b / GB:.4g} GB copied to the {'GPU' if device == 'cuda' else 'CPU from disk'} "
          f"by accelerate's hooks ({off_b / s / GB:.1f} GB/s effective){peak}")
    if a.compare_ms_per_layer:
        print(f"# freetoken {a.compare_ms_per_layer:.3f} ms/layer vs HF+accelerate {ms_layer:.3f} ms/layer: "
              f"{ms_layer / a.compare_ms_per_layer:.1f}x (issue-5 goal >= 10x)")
    return {"device_map": dm, "model": model, "s_per_token": s, "gpu_bytes": gpu_b, "offloaded_bytes": off_b}


def main(argv=None):
    try:
        return run(parse_args(argv))
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    except torch.OutOfMemoryError as e:
        print(f"error: out of GPU memory ({str(e).splitlines()[0]}); use fewer --layers or a smaller "
              f"--cache-frac", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
