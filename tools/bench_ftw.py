"""Benchmark FTW convert and load against the raw disk, in one run, on one table.

    python tools/bench_ftw.py --gb 4 [--threads 8] [--dir DIR] [--keep]
    python tools/bench_ftw.py --src HF_DIR          # an existing checkpoint instead

Steps (page cache dropped with posix_fadvise(DONTNEED) before every cold read):
  1. make a synthetic qwen3_moe-shaped bf16 checkpoint of ~GB bytes (per-expert 2-D tensors,
     2 shards, written directly as safetensors: no transformers needed)
  2. raw write: write + fsync as many bytes as the FTW file has, 8 MiB sequential pwrites
  3. raw copy: the source files, cold, copied to one file by the convert's thread count (8 MiB
     blocks, preallocated, O_DIRECT writes where allowed), then fsync: the same reads and
     writes as a convert without its CPU work; the ceiling for a cold convert on one disk
  4. convert, cold source (the user's case: reads and writes share the disk)
  5. convert, warm source (source in the page cache): the writer against raw write; and once
     more with page-cache writes instead of O_DIRECT (diagnostic)
  6. raw read: sequential O_DIRECT reads (8 MiB) of the expert-bank region of the FTW file,
     into a reused buffer (dd-like) and into a fresh buffer of the whole size
  7. load: FTWFile.load_banks (O_DIRECT, several threads) of the same bytes
Goals: cold convert >= 0.8 x raw copy, warm convert >= 0.8 x raw write,
load >= 0.9 x raw O_DIRECT read.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import struct
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

BLOCK = 8 << 20
ALIGN = 4096


def drop_cache(path) -> None:
    """Evict a file's clean pages (works without root; O_DIRECT bypasses the cache anyway)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass
    finally:
        os.close(fd)


def write_safetensors(path: Path, shapes: dict, rng) -> int:
    """Stream a bf16 safetensors file of random bits for {name: shape}; returns its size."""
    header, pos = {}, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    noise = rng.integers(0, 1 << 16, size=BLOCK // 2, dtype=np.uint16)
    noise &= 0x7F7F  # finite values: no NaN/inf patterns
    raw = noise.tobytes()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        left, k = pos, 0
        while left:
            n = min(left, BLOCK)
            start = (k * 4099) % (BLOCK - n + 1) if n < BLOCK else 0  # vary bytes between tensors
            f.write(raw[start:start + n])
            left -= n
            k += 1
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(text) + pos


def checkpoint_tensors(cfg: dict) -> dict:
    """{Hugging Face name: shape} of a qwen3_moe checkpoint of config `cfg`."""
    D, V, L, E = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"], cfg["num_experts"]
    hd, H, KV = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    I = cfg["moe_intermediate_size"]
    out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(L):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                    p + "self_attn.q_proj.weight": (H * hd, D), p + "self_attn.k_proj.weight": (KV * hd, D),
                    p + "self_attn.v_proj.weight": (KV * hd, D), p + "self_attn.o_proj.weight": (D, H * hd),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate.weight": (E, D)})
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            out.update({q + "gate_proj.weight": (I, D), q + "up_proj.weight": (I, D),
                        q + "down_proj.weight": (D, I)})
    return out


def make_checkpoint(out: Path, gb: float, hidden: int, inter: int, experts: int, seed: int = 0) -> Path:
    """A qwen3_moe-shaped bf16 checkpoint of about `gb` GB with per-expert 2-D tensors."""
    out.mkdir(parents=True, exist_ok=True)
    vocab, heads, kv, hd = 32000, 16, 4, hidden // 16
    per_layer = experts * 3 * inter * hidden * 2
    layers = max(1, round((gb * 1e9 - 2 * vocab * hidden * 2) / per_layer))
    cfg = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": vocab,
           "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "head_dim": hd, "intermediate_size": 4 * inter,
           "moe_intermediate_size": inter, "num_experts": experts, "num_experts_per_tok": 8,
           "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "decoder_sparse_step": 1,
           "mlp_only_layers": [], "bos_token_id": None, "eos_token_id": 0, "hidden_act": "silu"}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    first = layers // 2  # two shards: the first half of the layers with the embeddings
    shards = [{}, {}]
    for n, shape in checkpoint_tensors(cfg).items():
        layer = int(n.split(".")[2]) if n.startswith("model.layers.") else -1
        shards[layer >= first][n] = shape
    rng = np.random.default_rng(seed)
    weight_map = {}
    for k, shapes in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / name, shapes, rng)
        weight_map.update({n: name for n in shapes})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def raw_write(path: Path, nbytes: int) -> float:
    buf = np.random.default_rng(1).integers(0, 255, BLOCK, dtype=np.uint8).tobytes()
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < nbytes:
            done += os.pwrite(fd, memoryview(buf)[:min(BLOCK, nbytes - done)], done)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t


def raw_copy(sources: list, dst: Path, threads: int) -> tuple:
    """Copy the (cold) source files into one preallocated file: `threads` workers each read an
    8 MiB block (buffered) and write it (O_DIRECT where allowed), then fsync. Returns (bytes, s)."""
    for f in sources:
        drop_cache(f)
    jobs, pos = [], 0
    for k, f in enumerate(sources):
        size = f.stat().st_size
        jobs += [(k, a, min(BLOCK, size - a), pos + a) for a in range(0, size, BLOCK)]
        pos = -(-(pos + size) // ALIGN) * ALIGN
    total = sum(n for _, _, n, _ in jobs)
    t = time.perf_counter()
    fds = [os.open(f, os.O_RDONLY) for f in sources]
    out = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        direct = os.open(dst, os.O_WRONLY | os.O_DIRECT)
    except (AttributeError, OSError):
        direct = out
    todo, lock = iter(jobs), threading.Lock()

    def worker():
        mv = memoryview(mmap.mmap(-1, BLOCK))
        while True:
            with lock:
                job = next(todo, None)
            if job is None:
                return
            k, a, n, at = job
            got = 0
            while got < n:
                got += os.preadv(fds[k], [mv[got:n]], a + got)
            os.pwrite(direct, mv[:-(-n // ALIGN) * ALIGN], at)

    try:
        os.posix_fallocate(out, 0, pos)
        with ThreadPoolExecutor(threads) as pool:
            for fut in [pool.submit(worker) for _ in range(threads)]:
                fut.result()
        os.fsync(out)
    finally:
        for fd in {*fds, out, direct}:
            os.close(fd)
    return total, time.perf_counter() - t


def warm(sources: list) -> None:
    """Read the files once so that they sit in the page cache."""
    for f in sources:
        with open(f, "rb", buffering=0) as fp:
            while fp.read(BLOCK):
                pass


def raw_direct_read(path: Path, start: int, nbytes: int, fresh: bool = False) -> float:
    """Sequential O_DIRECT reads of [start, start + nbytes): into one reused 8 MiB page-aligned
    buffer (dd-like), or with fresh=True into one new buffer of nbytes (pays the kernel's
    first-touch page zeroing, as any load into new memory must; private memory like the loader's)."""
    drop_cache(path)
    buf = mmap.mmap(-1, nbytes if fresh else BLOCK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mv = memoryview(buf)
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    t = time.perf_counter()
    try:
        done = 0
        while done < nbytes:
            at = done if fresh else 0
            n = os.preadv(fd, [mv[at:at + min(BLOCK, nbytes - done)]], start + done)
            if n <= 0:
                break
            done += n
    finally:
        os.close(fd)
        t_end = time.perf_counter()
        mv.release()
        buf.close()
    return t_end - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=4.0, help="size of the synthetic checkpoint")
    p.add_argument("--src", help="use this HF checkpoint instead of a synthetic one")
    p.add_argument("--threads", type=int, default=None, help="convert threads (default: the writer's)")
    p.add_argument("--load-threads", type=int, default=None, help="load_banks threads (default: the loader's)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--dir", default=None, help="work folder on the disk to measure (default: ./bench_ftw_*)")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    args = p.parse_args(argv)

    import inspect

    import ftw
    from ftw.convert import convert
    try:
        from ftw.writer import default_threads
    except ImportError:  # an older ftw (before/after comparisons): its old default
        def default_threads():
            return min(8, os.cpu_count() or 1)
    has_direct = "direct" in inspect.signature(convert).parameters

    threads = args.threads or default_threads()
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_ftw_", dir=os.getcwd()))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t = time.perf_counter()
        src = Path(args.src) if args.src else make_checkpoint(work / "hf", args.gb, args.hidden, args.inter, args.experts)
        gen_s = time.perf_counter() - t
        shards = sorted(src.glob("*.safetensors"))
        out = work / "model.ftw"

        def timed_convert(**kw) -> float:
            t = time.perf_counter()
            convert(src, out, threads=args.threads, force=True, progress=False, **kw)
            return time.perf_counter() - t

        for f in shards:
            drop_cache(f)
        conv_cold = timed_convert()
        size = out.stat().st_size
        drop_cache(out)
        raw_w = raw_write(work / "raw.bin", size)
        copy_bytes, raw_c = raw_copy(shards, work / "raw.bin", threads)
        (work / "raw.bin").unlink()
        warm(shards)
        conv_warm = timed_convert()
        conv_warm_buf = None
        if has_direct:
            warm(shards)
            conv_warm_buf = timed_convert(direct=False)
        drop_cache(out)
        with ftw.open(out) as f:
            banks = sorted(f.banks.values(), key=lambda b: b.offset)
            bank_bytes = sum(b.nbytes for b in banks)
            raw_r = raw_direct_read(out, f.data_offset + banks[0].offset, bank_bytes)
            raw_fresh = raw_direct_read(out, f.data_offset + banks[0].offset, bank_bytes, fresh=True)
            drop_cache(out)
            t = time.perf_counter()
            loaded = f.load_banks(threads=args.load_threads)
            load_s = time.perf_counter() - t
            del loaded
        gbps = {"w": size / raw_w, "c": copy_bytes / raw_c, "r": bank_bytes / raw_r}
        rows = [  # name, bytes, seconds, reference row key or None, goal ratio
            ("raw write+fsync", size, raw_w, None, None),
            ("raw copy (cold read + write + fsync)", copy_bytes, raw_c, None, None),
            ("convert, cold source", size, conv_cold, "c", 0.80),
            ("convert, warm source", size, conv_warm, "w", 0.80),
            ("  same, page-cache writes", size, conv_warm_buf, "w", None),
            ("raw O_DIRECT read", bank_bytes, raw_r, None, None),
            ("  same, fresh buffer", bank_bytes, raw_fresh, None, None),
            ("load_banks", bank_bytes, load_s, "r", 0.90)]
        names = {"w": "raw write", "c": "raw copy", "r": "raw read"}
        print(f"# bench_ftw: {platform.node()} {platform.machine()} {os.cpu_count()} cores, python "
              f"{platform.python_version()}, dir {work}, source "
              f"{src if args.src else f'synthetic {args.gb} GB (generated in {gen_s:.1f} s)'}, "
              f"convert threads {threads}, load threads {args.load_threads or 'default'}")
        print(f"{'op':38} {'GB':>6} {'s':>7} {'GB/s':>6} {'ratio':>16}  goal")
        misses = []
        for name, n, s, ref, goal in rows:
            if s is None:
                print(f"{name:38} {'n/a':>6}")
                continue
            ratio = "" if ref is None else f"{n / s / gbps[ref]:.2f} x {names[ref]}"
            verdict = ""
            if goal is not None:
                ok = n / s / gbps[ref] >= goal
                verdict = f">= {goal:.2f} x {names[ref]}: {'ok' if ok else 'MISSED'}"
                misses += [] if ok else [name]
            print(f"{name:38} {n / 1e9:6.2f} {s:7.2f} {n / 1e9 / s:6.2f} {ratio:>16}  {verdict}")
        print(f"cold convert vs raw write: {size / conv_cold / gbps['w']:.2f}; load_banks vs the "
              f"fresh-buffer raw read: {raw_fresh / load_s:.2f}; goals missed: {', '.join(misses) or 'none'}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
