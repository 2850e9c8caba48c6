"""`freetoken convert`: a Hugging Face safetensors checkpoint -> one FTW file.

The only place weights are reshaped: per-expert or fused source tensors become one slot per
(layer, expert) (SPEC.md §5.2). Names come from names.py, config rules from hf_config.py,
bytes from hf_source.py, which source tensor feeds what from tensor_map.py; writer.py does
layout, parallel pwrite and the atomic rename.
"""
from __future__ import annotations

import hashlib
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Optional

import numpy as np

from . import constants as C
from . import hf_config, names, quant as Q, writer
from .errors import (ConvertError, OutputExistsError, QuantShapeError, SourceNotFoundError,
                     SplitSizeError, UnsupportedConfigError)
from .hf_source import Reader, SourceTensor, check_dtypes, convert_dtype, index_checkpoint
from .tensor_map import map_tensors

_TOKENIZER_CONFIG_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "add_bos_token", "add_eos_token")


def convert(src_dir, output, dtype: str = "auto", threads: Optional[int] = None,
            split_size=None, force: bool = False, progress: bool = False, direct: bool = True,
            quant: str = C.QUANT_NONE) -> Path:
    """Convert the checkpoint in `src_dir` into `output` (.ftw); returns the output path.

    dtype: auto (keep each source dtype) | bf16 | fp16 | fp32. split_size: bytes or "4G"-style.
    direct=False writes through the page cache instead of O_DIRECT (same bytes; benchmarks).
    quant: "none" or a quant type (SPEC.md §9): the routed experts' banks are quantized on the
    way in (ftw/quant.py's reference quantizer, from the values in `dtype`, which stays their
    compute dtype); every other tensor keeps `dtype`.
    Raises ftw.errors.ConvertError subclasses for anything the user can fix.
    """
    if dtype not in ("auto", *C.DTYPE_SIZES):
        raise ConvertError(f"--dtype {dtype!r}: choose auto, bf16, fp16 or fp32")
    if quant != C.QUANT_NONE:
        Q.quant_type(quant)  # UnknownQuantError names the known types
    output = Path(output)
    if output.exists() and not force:  # before any reading: fail fast
        raise OutputExistsError(f"{output} exists; pass --force to overwrite it or choose another -o")
    split = parse_size(split_size)
    src = Path(src_dir)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise SourceNotFoundError(f"{src} has no config.json; give the folder of a Hugging Face checkpoint")
    cfg = _read_json(cfg_path)
    family = hf_config.detect_family(cfg)
    gen_path = src / "generation_config.json"
    config = hf_config.normalise(cfg, family, _read_json(gen_path) if gen_path.is_file() else None)
    sources = index_checkpoint(src)
    plan = map_tensors(family, sources, config)
    _check_fp8(cfg, plan, sources)
    published = set(plan.quantized_names())  # MXFP4 halves, FP8 weights and scales (checked)
    check_dtypes([sources[n] for n in plan.used_names() if n not in published])
    config["source_dtype"] = _majority_dtype([sources[n] for n in plan.used_names() if n not in published])
    fp8_out = config["source_dtype"] if dtype == "auto" else dtype  # what FP8 tensors compute in

    reader = Reader()
    try:
        tensors, dequantized = [], {}
        for canon, hf in plan.tensors.items():
            if hf in plan.fp8_scales:  # a dense FP8 tensor: its values, in fp8_out
                tensors.append(_fp8_tensor_entry(canon, sources[hf], sources[plan.fp8_scales[hf]],
                                                 fp8_out, reader))
                dequantized[canon] = f"{hf}: fp8_e4m3 (128 x 128 block scales) -> {fp8_out}"
            else:
                tensors.append(_tensor_entry(canon, sources[hf], dtype, reader))
        banks = [_bank_entry(layer, plan.experts[layer], config, dtype, reader, sources, quant,
                             plan.fp8_scales, fp8_out)
                 for layer in sorted(plan.experts)]
        metadata = _metadata(src, cfg, family, config, sources, plan.ignored_reasons)
        if dequantized:
            metadata[C.KEY_DEQUANTIZED] = dict(sorted(dequantized.items()))
        if plan.ignored and progress:
            print(f"note: skipping {len(plan.ignored)} tensor(s) inference never uses "
                  f"(e.g. {plan.ignored[0]})", file=sys.stderr)
        writer.write(str(output), metadata, tensors, banks, threads=threads, split_size=split,
                     force=force, progress=progress, direct=direct)
    finally:
        reader.close()
    return output


def _tensor_entry(canon: str, t: SourceTensor, dtype: str, reader: Reader) -> writer.TensorEntry:
    out = t.dtype if dtype == "auto" else dtype
    return writer.TensorEntry(canon, out, t.shape, lambda: reader.chunks(t, out), lambda: reader.prefetch(t))


FP8_BLOCK = 128  # DeepSeek-V3 / Qwen FP8: one weight_scale_inv per 128 x 128 tile (SPEC.md §9.1)


def _check_fp8(cfg: dict, plan, sources: dict) -> None:
    """Every F8_E4M3 tensor convert uses is a 2-D weight with its weight_scale_inv, fp32 (or
    bf16, widened exactly) [ceil(out/128), ceil(in/128)], and the config's block is 128 x 128."""
    for hf in plan.used_names():
        if sources[hf].st_dtype == "F8_E4M3" and hf not in plan.fp8_scales:
            raise UnsupportedConfigError(
                f"{hf} is F8_E4M3 but the checkpoint has no {hf}_scale_inv beside it; convert reads "
                "FP8 checkpoints in the DeepSeek-V3 / Qwen layout (128 x 128 block scales) only")
    if not plan.fp8_scales:
        return
    block = (cfg.get("quantization_config") or {}).get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])
    if list(block) != [FP8_BLOCK, FP8_BLOCK]:
        raise UnsupportedConfigError(
            f"quantization_config.weight_block_size is {block}; freetoken's fp8_e4m3 (SPEC.md §9.1) "
            f"has {FP8_BLOCK} x {FP8_BLOCK} blocks: use a bf16 release of this model")
    for w, s in plan.fp8_scales.items():
        tw, ts = sources[w], sources[s]
        want = tuple(-(-d // FP8_BLOCK) for d in tw.shape)
        if tw.st_dtype != "F8_E4M3" or len(tw.shape) != 2:
            raise UnsupportedConfigError(f"{s} scales {w}, which is {tw.st_dtype} {list(tw.shape)}, "
                                         "not a 2-D F8_E4M3 weight; this FP8 layout is not known")
        if ts.st_dtype not in ("F32", "BF16") or tuple(ts.shape) != want:
            raise UnsupportedConfigError(f"{s} is {ts.st_dtype} {list(ts.shape)}; the block scales of "
                                         f"{w} {list(tw.shape)} are F32 {list(want)}")


def _fp8_scales(reader: Reader, s: SourceTensor) -> np.ndarray:
    """A weight_scale_inv as fp32 (bf16 widens exactly), flat."""
    return reader.array(s, "fp32")


def _fp8_bytes(reader: Reader, w: SourceTensor, s: SourceTensor) -> np.ndarray:
    """An FP8 weight and its scales as an fp8_e4m3 tensor's bytes (SPEC.md §9.2), unchanged."""
    qs = np.frombuffer(reader.read(w), np.uint8)
    return np.frombuffer(Q.assemble("fp8_e4m3", w.shape, qs, _fp8_scales(reader, s)), np.uint8)


def _fp8_tensor_entry(canon: str, w: SourceTensor, s: SourceTensor, out: str,
                      reader: Reader) -> writer.TensorEntry:
    """A dense FP8 weight dequantized to `out` (SPEC.md §9.1: e4m3 * scale in fp32, then rounded
    to `out` once), 128 rows (one tile row) at a time."""
    rows, cols = w.shape

    def chunks():
        scales = _fp8_scales(reader, s).reshape(-1, -(-cols // FP8_BLOCK))
        for r0 in range(0, rows, FP8_BLOCK):
            n = min(FP8_BLOCK, rows - r0)
            qs = np.frombuffer(reader.read(w, r0 * cols, n * cols), np.uint8)
            data = Q.assemble("fp8_e4m3", (n, cols), qs, scales[r0 // FP8_BLOCK])
            yield convert_dtype(Q.dequantize(data, "fp8_e4m3", (n, cols)).reshape(-1), "fp32", out)

    return writer.TensorEntry(canon, out, w.shape, chunks, lambda: reader.prefetch(w))


def _bank_entry(layer: int, src: dict, config: dict, dtype: str, reader: Reader,
                sources: dict, quant: str = C.QUANT_NONE, fp8_scales: Optional[dict] = None,
                fp8_out: str = "bf16") -> writer.BankEntry:
    """A bank whose read_expert(e) assembles expert e's gate/up/down from any source layout
    (quantized: their SPEC.md §9.2 bytes). The hub's MXFP4 experts (gpt-oss: blocks and scales
    fused tensors) make an mxfp4 bank whose bytes are the published ones, moved row by row;
    DeepSeek-V3 / Qwen FP8 experts (per expert, weight F8_E4M3 + weight_scale_inv) an fp8_e4m3
    bank of the published bytes, computed in fp8_out."""
    E, D, I = config["num_experts"], config["hidden_size"], config["moe_intermediate_size"]
    per, fused = src["per_expert"], src["fused"]
    fp8_scales = fp8_scales or {}
    fp8 = [hf for hf in list(per.values()) + [hf for hf, _ in fused] if hf in fp8_scales]
    if fp8:
        return _fp8_bank_entry(layer, src, E, I, D, reader, sources, quant, fp8_scales, fp8_out)
    plain = [(hf, f) for hf, f in fused if not f.part]
    first = sources[per[(0, "gate")]] if (0, "gate") in per else sources[plain[0][0]]
    has_bias = any(f.is_bias for _, f in fused)
    is_mxfp4 = any(f.part for _, f in fused)
    out = first.dtype if dtype == "auto" else dtype

    def read_expert(e: int) -> dict:
        arrays, parts = {}, {"blocks": {}, "scales": {}}
        for hf, f in fused:
            t = sources[hf]
            block = t.nbytes // E  # expert e's [out, in] ([in, out]; bias [out]) block: contiguous
            is_down = f.projections[0].startswith("down")
            rows = len(f.projections) * (D if is_down else I)
            cols = I if is_down else D
            if f.part:  # MXFP4 blocks or scales: uint8 bytes, one row per output, copied
                a = np.frombuffer(reader.read(t, e * block, block), np.uint8).reshape(rows, -1)
            else:
                a = reader.array(t, out, e * block, block)
            if f.is_bias:
                a = a.reshape(rows)
            elif not f.part:
                a = a.reshape(cols, rows).T if f.transposed else a.reshape(rows, cols)
            target = parts[f.part] if f.part else arrays
            if len(f.projections) == 2:
                halves = (a[0::2], a[1::2]) if f.interleaved else (a[:I], a[I:])
                target.update(zip(f.projections, halves))
            else:
                target[f.projections[0]] = a
        for p, qs in parts["blocks"].items():
            shape = (D, I) if p == "down" else (I, D)
            arrays[p] = np.frombuffer(Q.assemble("mxfp4", shape, qs, parts["scales"][p]), np.uint8)
        for p in names.PROJECTIONS:
            if p not in arrays:
                t = sources[per[(e, p)]]
                arrays[p] = reader.array(t, out).reshape(t.shape)
        return {p: a.copy(order="C") if not a.flags.c_contiguous else a for p, a in arrays.items()}

    def ranges(e: int) -> dict:
        """{projection: (source, start, nbytes)} for every projection whose bytes are one source
        range, unchanged (no dtype conversion, no transpose, no de-interleave)."""
        spans = {}
        for hf, f in fused:
            t = sources[hf]
            if t.dtype == out and not f.transposed and not (f.interleaved and len(f.projections) == 2):
                part = t.nbytes // E // len(f.projections)  # [out, in] rows of each projection
                for k, p in enumerate(f.projections):
                    spans[p] = (t, (e * len(f.projections) + k) * part, part)
        for p in names.PROJECTIONS:
            t = sources.get(per.get((e, p)))
            if t is not None and t.dtype == out:
                spans[p] = (t, 0, t.nbytes)
        return spans

    def read_expert_into(e: int, views: dict) -> None:
        spans = ranges(e)
        if len(spans) < len(views):  # some projection needs converting: assemble, then copy
            for p, a in read_expert(e).items():
                np.copyto(views[p], a, casting="no")
            return
        for p, (t, start, nbytes) in spans.items():
            reader.read_into(t, memoryview(views[p]).cast("B"), start)

    def prefetch(e: int) -> None:
        for hf, _ in fused:
            t = sources[hf]
            reader.prefetch(t, e * (t.nbytes // E), t.nbytes // E)
        for p in names.PROJECTIONS:
            if (e, p) in per:
                reader.prefetch(sources[per[(e, p)]])

    if is_mxfp4:
        if quant not in (C.QUANT_NONE, "mxfp4"):
            raise ConvertError(f"--quant {quant}: layer {layer}'s experts are MXFP4 as published, "
                               "which convert copies into mxfp4 banks unchanged (never "
                               "requantized); convert without --quant")
        return writer.BankEntry(layer, out, E, I, D, read_expert, None, prefetch, quant="mxfp4",
                                has_bias=has_bias)
    if quant != C.QUANT_NONE:
        def read_quantized(e: int) -> dict:  # the weights quantized; biases stay `out` (§5.2)
            return {p: a if p in C.BIAS_PROJECTIONS else
                    np.frombuffer(Q.quantize(_as_fp32(a, out), quant), dtype=np.uint8)
                    for p, a in read_expert(e).items()}
        try:
            return writer.BankEntry(layer, out, E, I, D, read_quantized, None, prefetch, quant=quant,
                                    has_bias=has_bias)
        except QuantShapeError as e:
            raise ConvertError(f"--quant {quant}: layer {layer}'s experts ({I} x {D}) do not fit: "
                               f"{e}") from None
    return writer.BankEntry(layer, out, E, I, D, read_expert, read_expert_into, prefetch,
                            has_bias=has_bias)


def _fp8_bank_entry(layer: int, src: dict, E: int, I: int, D: int, reader: Reader, sources: dict,
                    quant: str, fp8_scales: dict, out: str) -> writer.BankEntry:
    """An fp8_e4m3 bank whose slots hold each expert's published e4m3 bytes and block scales."""
    per = src["per_expert"]
    if src["fused"] or len(per) != E * len(names.PROJECTIONS) or not all(
            hf in fp8_scales for hf in per.values()):
        raise UnsupportedConfigError(
            f"layer {layer}'s experts are partly FP8 or fused FP8 tensors; convert reads FP8 "
            "experts stored per expert (DeepSeek-V3 / Qwen: experts.E.gate_proj.weight and its "
            "weight_scale_inv), every one of them FP8")
    if quant not in (C.QUANT_NONE, "fp8_e4m3"):
        raise ConvertError(f"--quant {quant}: layer {layer}'s experts are FP8 as published, which "
                           "convert copies into fp8_e4m3 banks unchanged (never requantized); "
                           "convert without --quant")

    def read_expert(e: int) -> dict:
        return {p: _fp8_bytes(reader, sources[per[(e, p)]], sources[fp8_scales[per[(e, p)]]])
                for p in names.PROJECTIONS}

    def prefetch(e: int) -> None:
        for p in names.PROJECTIONS:
            reader.prefetch(sources[per[(e, p)]])
            reader.prefetch(sources[fp8_scales[per[(e, p)]]])

    return writer.BankEntry(layer, out, E, I, D, read_expert, None, prefetch, quant="fp8_e4m3")


def _as_fp32(a: np.ndarray, dtype: str) -> np.ndarray:
    """Values held in `dtype`'s numpy form (bf16: its uint16 bits) as fp32, exactly."""
    if dtype == "bf16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def _metadata(src: Path, cfg: dict, family, config: dict, sources: dict, ignored: dict) -> dict:
    structure = {"config": cfg, "tensors": sorted([n, t.st_dtype, list(t.shape)] for n, t in sources.items())}
    fingerprint = hashlib.sha256(writer.dumps(structure)).hexdigest()
    tok_cfg = _read_json(src / "tokenizer_config.json") if (src / "tokenizer_config.json").is_file() else {}
    template = tok_cfg.get("chat_template")
    if (src / "chat_template.jinja").is_file():
        template = (src / "chat_template.jinja").read_text(encoding="utf-8")
    elif isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    tok_json = src / "tokenizer.json"
    return {
        C.KEY_CONFIG: config,
        C.KEY_TOKENIZER_JSON: tok_json.read_text(encoding="utf-8") if tok_json.is_file() else None,
        C.KEY_CHAT_TEMPLATE: template if isinstance(template, str) else None,
        C.KEY_TOKENIZER_CONFIG: {k: tok_cfg[k] for k in _TOKENIZER_CONFIG_KEYS if k in tok_cfg},
        C.KEY_SOURCE_FORMAT: "hf-safetensors",
        C.KEY_SOURCE_ARCH: cfg.get("model_type", family.name),
        C.KEY_SOURCE_FINGERPRINT: fingerprint,
        C.KEY_IGNORED: sorted(ignored),
        C.KEY_IGNORED_REASONS: dict(sorted(ignored.items())),
        C.KEY_CONVERTER_NAME: "freetoken convert",
        C.KEY_CONVERTER_VERSION: _converter_version(),
    }


def _majority_dtype(tensors) -> str:
    total = defaultdict(int)
    for t in tensors:
        total[t.dtype] += t.nbytes
    return max(sorted(total), key=lambda d: total[d])


def _converter_version() -> str:
    try:
        from importlib.metadata import version
        return version("freetoken")
    except Exception:  # noqa: BLE001 - running from a source tree without install metadata
        return "unknown"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SourceNotFoundError(f"cannot read {path}: {e}") from None


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(value) -> Optional[int]:
    """None, an int, or "4G"/"500M"/"4096" (binary units, optional trailing B or iB)."""
    if value is None or isinstance(value, int):
        return value
    text = str(value).strip().upper().removesuffix("IB").removesuffix("B")
    unit = text[-1:] if text[-1:] in _SIZE_UNITS and text[-1:] else ""
    number = text[:-1] if unit else text
    try:
        size = int(float(number) * _SIZE_UNITS[unit])
    except ValueError:
        raise SplitSizeError(f"--split-size {value!r}: give a size like 4G, 500M or 1073741824") from None
    if size < 2 * C.ALIGNMENT:
        raise SplitSizeError(f"--split-size {value!r} is too small")
    return size
