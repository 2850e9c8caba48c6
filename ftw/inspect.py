"""`freetoken inspect`: print what is inside an FTW file, like gguf-dump.

Text: prefix, files, metadata, model config, tensor table, expert-bank table with sizes and
quant types (SPEC.md §9; "none" when not quantized).
`as_json`: the same as one JSON object (tokenizer.json summarised by length and sha256).
"""
from __future__ import annotations

import hashlib
import json

from . import constants as C
from .reader import open as open_ftw


def inspect_file(path, verify: bool = False, as_json: bool = False) -> str:
    with open_ftw(path) as f:
        if verify:
            f.verify()
        return _as_json(f, verify) if as_json else _as_text(f, verify)


def _summary(f) -> dict:
    meta = dict(f.metadata)
    tok = meta.get(C.KEY_TOKENIZER_JSON)
    if isinstance(tok, str):
        meta[C.KEY_TOKENIZER_JSON] = {"chars": len(tok), "sha256": hashlib.sha256(tok.encode()).hexdigest()}
    return meta


def _as_json(f, verified: bool) -> str:
    out = {
        "path": f.path, "version": f.version, "header_len": f.header_len,
        "header_crc32": f"{f.header_crc32:08x}", "data_offset": f.data_offset, "files": f.files,
        "verified": verified, "metadata": _summary(f),
        "tensors": [{"name": t.name, "dtype": t.dtype, "quant": t.quant, "shape": list(t.shape), "file": t.file,
                     "offset": t.offset, "nbytes": t.nbytes, "crc32": f"{t.crc32:08x}"}
                    for t in f.tensors.values()],
        "banks": [{"layer": b.layer, "name": b.name, "dtype": b.dtype, "quant": b.quant, "file": b.file,
                   "offset": b.offset,
                   "num_experts": b.num_experts, "slot_stride": b.slot_stride, "nbytes": b.nbytes,
                   "projections": [{"name": p.name, "shape": list(p.shape), "offset": p.offset,
                                    "nbytes": p.nbytes} for p in b.projections]}
                  for b in f.banks.values()],
    }
    return json.dumps(out, indent=2, sort_keys=True)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _skipped(meta: dict) -> dict:
    """{source tensor: why it was skipped}; files older than source.ignored_reasons give none."""
    reasons = meta.get(C.KEY_IGNORED_REASONS) or {}
    return {name: reasons.get(name, "(no reason recorded)") for name in meta.get(C.KEY_IGNORED) or []}


def _as_text(f, verified: bool) -> str:
    lines = []
    add = lines.append
    tensor_bytes = sum(t.nbytes for t in f.tensors.values())
    bank_bytes = sum(b.nbytes for b in f.banks.values())
    add(f"* FTW version {f.version}, header {f.header_len} bytes (crc32 {f.header_crc32:08x}), "
        f"data at {f.data_offset}")
    for k, fi in enumerate(f.files):
        add(f"* file {k}: {fi['name']}  data {_size(fi['data_size'])} at {fi['data_offset']}")
    quants = sorted({b.quant for b in f.banks.values()})
    add(f"* {len(f.tensors)} tensors ({_size(tensor_bytes)}), {len(f.banks)} expert banks "
        f"({_size(bank_bytes)}, quant {', '.join(quants) or 'none'})"
        + ("; all checksums verified" if verified else ""))
    add("")
    add("* metadata:")
    for key, value in sorted(_summary(f).items()):
        if key in (C.KEY_CONFIG, C.KEY_IGNORED, C.KEY_IGNORED_REASONS, C.KEY_DEQUANTIZED):
            continue  # their own sections below
        text = json.dumps(value, sort_keys=True)
        add(f"  {key:26} {text if len(text) <= 100 else text[:97] + '...'}")
    add("")
    add("* model.config:")
    for key, value in sorted(f.config.items()):
        add(f"  {key:34} {json.dumps(value)}")
    add("")
    add(f"* family: {f.config.get('family')} (source {f.metadata.get(C.KEY_SOURCE_ARCH)})")
    skipped = _skipped(f.metadata)
    add(f"* skipped source tensors ({len(skipped)}):")
    for name, reason in skipped.items():
        add(f"  {name:60} {reason}")
    dequantized = f.metadata.get(C.KEY_DEQUANTIZED) or {}
    if dequantized:
        add(f"* dense tensors dequantized at convert ({len(dequantized)}; the source stored them "
            "quantized, the file holds their values in its dtype):")
        for name, how in sorted(dequantized.items()):
            add(f"  {name:60} {how}")
    add("")
    add("* tensors:")
    add(f"  {'#':>4}  {'name':40} {'dtype':5} {'quant':8} {'shape':>16} {'file':>4} {'offset':>14} {'size':>11}")
    for n, t in enumerate(f.tensors.values()):
        shape = "x".join(map(str, t.shape))
        add(f"  {n:4}  {t.name:40} {t.dtype:5} {t.quant:8} {shape:>16} {t.file:4} {t.offset:14} "
            f"{_size(t.nbytes):>11}")
    add("")
    add("* expert banks (slot e at offset + e * stride; projections inside a slot):")
    add(f"  {'layer':>5}  {'name':18} {'dtype':5} {'quant':8} {'experts':>7} {'stride':>10} {'file':>4} "
        f"{'offset':>14} {'size':>11}  projections")
    for b in f.banks.values():
        projs = ", ".join(f"{p.name} {'x'.join(map(str, p.shape))}@{p.offset}" for p in b.projections)
        add(f"  {b.layer:5}  {b.name:18} {b.dtype:5} {b.quant:8} {b.num_experts:7} {b.slot_stride:10} {b.file:4} "
            f"{b.offset:14} {_size(b.nbytes):>11}  {projs}")
    return "\n".join(lines)
