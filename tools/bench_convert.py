"""`freetoken convert --quant` against a raw write (issue 35): GB/s of converting a bf16
checkpoint of the Qwen3-30B-A3B shape (fewer layers, so that the checkpoint and its largest
output fit the disk) with no quant, q8_0 and q4_0, each beside a raw write of as many bytes as
its output through the writer's own output path. One run, one table.

Steps, in a work folder that is removed at the end (--keep: kept):
  1. write the bf16 checkpoint: bench_shapes' qwen3-30b-a3b config.json with --layers and
     --experts, Hugging Face tensor names (per-expert 2-D tensors), shards of ~4 GB, small
     normal values (an 8 MiB block tiled from shifting offsets; the quantizers see real data)
  2. per type: a raw write of the output's size (ftw.output.OutputFile, as the writer: the file
     preallocated, 8 MiB page-aligned blocks by the writer's thread count, O_DIRECT where the
     filesystem allows, then fsync), then the convert (ftw.convert.convert, what `freetoken
     convert` runs; the source read once before it, so it sits in the page cache: --cold drops
     it instead), then the output is deleted
GB/s: output bytes per second (the same bytes as the raw write); in GB/s: bf16 checkpoint bytes
per second (what a user waits for). The quantized converts quantize in the writer's threads
with freetoken._quant (ftw/quant.py's quantizer in C, the GIL released; the numpy reference
where the extension is not built), so a slow CPU, not only the disk, can bound them.

    python tools/bench_convert.py         # 12 layers x 128 experts: 16.2 GB bf16 (14.5 GB experts)
    python tools/bench_convert.py --layers 2 --experts 8 --quant none,q4_0   # a smoke run
"""
import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench_ftw import checkpoint_tensors, drop_cache, warm
from bench_moe_setup import hardware_line
from bench_shapes import shape_config

GB = 1e9
BLOCK = 8 << 20  # bytes per raw write block and per tiled value block
SHARD_BYTES = 4 << 30  # a new shard once one holds this much


def write_checkpoint(out: Path, layers: int, experts: int, seed: int = 0) -> int:
    """The bf16 checkpoint of the module docstring in `out`; returns its tensor bytes."""
    cfg = shape_config("qwen3-30b-a3b", layers=layers, experts=experts)
    cfg["architectures"] = ["Qwen3MoeForCausalLM"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    values = np.random.default_rng(seed).standard_normal(BLOCK // 2 + BLOCK // 4, np.float32) * 0.02
    block = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()  # bf16 bits (truncated)
    shards, size = [{}], 0
    for name, shape in checkpoint_tensors(cfg).items():
        n = int(np.prod(shape)) * 2
        if size and size + n > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = shape
        size += n
    weight_map, total = {}, 0
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        total += _write_shard(out / name, tensors, block)
        weight_map.update(dict.fromkeys(tensors, name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total


def _write_shard(path: Path, tensors: dict, block: bytes) -> int:
    header, pos = {}, 0
    for name, shape in tensors.items():
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    spare = len(block) - BLOCK
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        left, k = pos, 0
        while left:
            n = min(left, BLOCK)
            start = (k * 4099 * 2) % spare  # even: whole bf16 values; no two blocks alike
            f.write(block[start:start + n])
            left -= n
            k += 1
        f.flush()
        os.fsync(f.fileno())
    return pos


def raw_write(path: Path, nbytes: int, threads: int) -> float:
    """Seconds to write nbytes as the writer does (module docstring, step 2), fsync included."""
    from ftw.output import OutputFile, aligned_buffer
    t0 = time.perf_counter()
    out = OutputFile(str(path), nbytes)
    try:
        offsets = iter(range(0, -(-nbytes // BLOCK) * BLOCK, BLOCK))

        def worker(seed):
            buf = aligned_buffer(BLOCK)
            buf.write(np.random.default_rng(seed).integers(0, 256, BLOCK, np.uint8).tobytes())
            for off in offsets:  # (next() on a range iterator is atomic under the GIL)
                n = -(-min(BLOCK, nbytes - off) // 4096) * 4096
                out.write_block(memoryview(buf)[:n], off)
            buf.close()

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(worker, range(threads)))
        out.fsync()
    finally:
        out.close()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12, help="decoder layers of the checkpoint [12]")
    ap.add_argument("--experts", type=int, default=128, help="experts per layer [128]")
    ap.add_argument("--quant", default="none,q8_0,q4_0", help="convert --quant values, a row each")
    ap.add_argument("--threads", type=int, default=None, help="convert and raw write threads [the writer's]")
    ap.add_argument("--cold", action="store_true",
                    help="drop the source from the page cache before each convert")
    ap.add_argument("--dir", default=None, help="work folder on the disk to measure [./bench_convert_*]")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    a = ap.parse_args(argv)

    from ftw import quant as Q
    from ftw.convert import convert
    from ftw.writer import default_threads
    quants = [q for q in a.quant.split(",") if q]
    for q in quants:
        if q != "none":
            Q.quant_type(q)  # UnknownQuantError names the known types
    threads = a.threads or default_threads()
    cfg = shape_config("qwen3-30b-a3b", layers=a.layers, experts=a.experts)
    src_bytes = sum(int(np.prod(s)) * 2 for s in checkpoint_tensors(cfg).values())
    work = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="bench_convert_", dir=os.getcwd()))
    work.mkdir(parents=True, exist_ok=True)
    need = 2 * src_bytes + GB  # the checkpoint, the largest output (no quant), a margin
    free = shutil.disk_usage(work).free
    if free < need:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        sys.exit(f"error: {work} has {free / GB:.1f} GB free; --layers {a.layers} --experts "
                 f"{a.experts} needs {need / GB:.1f} GB (a {src_bytes / GB:.1f} GB checkpoint and "
                 f"its bf16 output): use fewer --layers")
    try:
        t0 = time.perf_counter()
        src = work / "hf"
        write_checkpoint(src, a.layers, a.experts)
        gen_s = time.perf_counter() - t0
        shards = sorted(src.glob("*.safetensors"))
        print(f"# bench_convert | {hardware_line('cpu')} | dir {work} ({free / GB:.0f} "
              f"GB free before) | writer threads {threads}", flush=True)
        print(f"# source: qwen3-30b-a3b shape, {a.layers} layers x {a.experts} experts, bf16, "
              f"{src_bytes / GB:.2f} GB in {len(shards)} shards (written in {gen_s:.1f} s); "
              f"{'cold (dropped before each convert)' if a.cold else 'warm (in the page cache)'}",
              flush=True)
        hdr = "| op | input GB | output GB | s | GB/s | in GB/s | x raw write |"
        rows = [hdr, "|---|---|---|---|---|---|---|"]
        for q in quants:
            out = work / f"model-{q}.ftw"
            if a.cold:
                for f in shards:
                    drop_cache(f)
            else:
                warm(shards)
            t = time.perf_counter()
            convert(src, out, threads=threads, force=True, progress=False, quant=q)
            conv_s = time.perf_counter() - t
            size = out.stat().st_size
            out.unlink()
            raw_s = raw_write(work / "raw.bin", size, threads)
            (work / "raw.bin").unlink()
            raw = size / raw_s
            rows.append(f"| raw write ({q}'s size) | - | {size / GB:.2f} | {raw_s:.2f} | "
                        f"{raw / GB:.2f} | - | 1.00 |")
            rows.append(f"| convert --quant {q} | {src_bytes / GB:.2f} | {size / GB:.2f} | {conv_s:.2f} | "
                        f"{size / conv_s / GB:.2f} | {src_bytes / conv_s / GB:.2f} | "
                        f"{size / conv_s / raw:.2f} |")
            print("\n".join(rows[-2:]), flush=True)
        print()
        print("\n".join(rows))
        print(f"# total {time.perf_counter() - t0:.0f} s")
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
