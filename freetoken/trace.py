"""Routing traces: which experts every token was routed to, in every MoE layer (issue 6).

Owns the trace file format and its writer/reader; needs only numpy, zstandard and json (no
torch), so `tools/replay_cache.py` can study traces anywhere. Replaying them is not done here.

    meta = {"family": "qwen3_moe", "num_layers": 4, "moe_layers": [0, 1, 2, 3],
            "num_experts": 16, "top_k": 2, "prompt": "def f(x):", "num_prompt_tokens": 5}
    with TraceWriter("run.fttrace", meta) as w:      # or w = TraceWriter(...); ...; w.close()
        w.add_step(ids_prefill, "prefill")         # ids [T, L, K] ints, L = len(moe_layers)
        w.add(ids_token, "decode")                 # ids [L, K]: one token
    meta, ids = read_trace("run.fttrace")          # ids np.int16 (int32 if E > 32767) [N, L, K]
    meta["phases"]  # np.uint8 [N]: index into PHASES, 0 prefill / 1 decode
    meta["steps"]   # np.uint32 [N]: which add/add_step call (forward step) each token came from

Arrays may be numpy arrays or CPU torch tensors (anything np.asarray takes). The writer buffers
in memory (a 10k-token trace of 48 layers x top-8 is 7.7 MB) and writes on close(): first to
`<path>.partial`, then renames, so a crashed run never leaves a truncated trace behind.

File layout (all little-endian):
    magic    8 bytes  b"FTTRACE\\0"
    version  u32      VERSION
    reserved u32      0
    hdr_len  u64      bytes of the JSON header that follows
    header   JSON     meta + {"num_tokens", "ids_dtype", "shape": [N, L, K]}
    body     one zstd frame of: phases u8[N] | steps u32[N] | ids [N, L, K] (ids_dtype, row-major)
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np

from .errors import FreetokenError

MAGIC = b"FTTRACE\0"
VERSION = 1
PHASES = ("prefill", "decode")
_PREFIX = struct.Struct("<8sIIQ")
_REQUIRED = ("num_layers", "moe_layers", "num_experts", "top_k")


class TraceError(FreetokenError):
    """A trace file or trace record is malformed (wrong magic/version, shape, expert id)."""


class TraceWriter:
    """Collects routed expert ids token by token and writes one trace file on close().

    meta must hold num_layers, moe_layers (list of layer ids, one column per MoE layer),
    num_experts and top_k; any other JSON-able keys (family, prompt, ...) are kept as given.
    """

    def __init__(self, path, meta: dict):
        missing = [k for k in _REQUIRED if k not in meta]
        if missing:
            raise TraceError(f"trace metadata lacks {', '.join(missing)}: the writer needs them")
        self.path = os.fspath(path)
        self.meta = dict(meta)
        self.shape = (len(self.meta["moe_layers"]), int(self.meta["top_k"]))  # (L, K)
        self.num_experts = int(self.meta["num_experts"])
        self.dtype = np.int16 if self.num_experts <= np.iinfo(np.int16).max else np.int32
        self._ids: list[np.ndarray] = []
        self._phases: list[np.ndarray] = []
        self._steps: list[np.ndarray] = []
        self._num_steps = 0
        self.closed = False

    def add(self, expert_ids, phase: str = "decode") -> None:
        """One token: expert_ids [L, K]."""
        self.add_step(np.asarray(expert_ids)[None], phase)

    def add_step(self, expert_ids, phase: str) -> None:
        """One forward step of T tokens: expert_ids [T, L, K]; phase 'prefill' or 'decode'."""
        if self.closed:
            raise TraceError("trace writer is closed: create a new TraceWriter")
        if phase not in PHASES:
            raise TraceError(f"unknown phase {phase!r}: use 'prefill' or 'decode'")
        ids = np.asarray(expert_ids)
        if ids.ndim != 3 or ids.shape[1:] != self.shape:
            raise TraceError(f"expert ids of shape {tuple(ids.shape)}: expected [T, {self.shape[0]}, "
                             f"{self.shape[1]}] (tokens, MoE layers, top_k)")
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_experts):
            raise TraceError(f"expert id out of range [0, {self.num_experts}) in trace step")
        num_tokens = ids.shape[0]
        self._ids.append(ids.astype(self.dtype))
        self._phases.append(np.full(num_tokens, PHASES.index(phase), np.uint8))
        self._steps.append(np.full(num_tokens, self._num_steps, np.uint32))
        self._num_steps += 1

    def close(self) -> str:
        """Write the file (atomically) and return its path; calling it twice is harmless."""
        if self.closed:
            return self.path
        import zstandard

        L, K = self.shape
        ids = np.concatenate(self._ids) if self._ids else np.zeros((0, L, K), self.dtype)
        phases = np.concatenate(self._phases) if self._phases else np.zeros(0, np.uint8)
        steps = np.concatenate(self._steps) if self._steps else np.zeros(0, np.uint32)
        header = dict(self.meta, num_tokens=int(ids.shape[0]), ids_dtype=np.dtype(self.dtype).name,
                      shape=[int(ids.shape[0]), L, K])
        hdr = json.dumps(header, sort_keys=True).encode()
        body = phases.tobytes() + steps.astype("<u4").tobytes() + ids.astype(ids.dtype.newbyteorder("<")).tobytes()
        partial = self.path + ".partial"
        with open(partial, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, VERSION, 0, len(hdr)))
            f.write(hdr)
            f.write(zstandard.ZstdCompressor(level=10).compress(body))
        os.replace(partial, self.path)
        self.closed = True
        return self.path

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()


def read_trace(path) -> tuple[dict, np.ndarray]:
    """Read a trace: (meta with 'phases' and 'steps' arrays added, ids [N, L, K])."""
    import zstandard

    with open(path, "rb") as f:
        data = f.read()
    if len(data) < _PREFIX.size or data[:8] != MAGIC:
        raise TraceError(f"{path} is not a freetoken trace (bad magic): pass a file written by --trace-out")
    _, version, _, hdr_len = _PREFIX.unpack_from(data)
    if version != VERSION:
        raise TraceError(f"{path} is trace version {version}; this freetoken reads version {VERSION}")
    end = _PREFIX.size + hdr_len
    try:
        meta = json.loads(data[_PREFIX.size:end])
        N, L, K = meta["shape"]
        dtype = np.dtype(meta["ids_dtype"]).newbyteorder("<")
        body = zstandard.ZstdDecompressor().decompress(data[end:], max_output_size=1 << 34)
    except (ValueError, KeyError, TypeError, zstandard.ZstdError) as exc:
        raise TraceError(f"{path} is a damaged trace ({exc}): record it again") from exc
    if len(body) != N * (1 + 4 + L * K * dtype.itemsize):
        raise TraceError(f"{path} is truncated: body has {len(body)} bytes for {N} tokens; record it again")
    meta["phases"] = np.frombuffer(body, np.uint8, N)
    meta["steps"] = np.frombuffer(body, "<u4", N, offset=N).astype(np.uint32)
    ids = np.frombuffer(body, dtype, N * L * K, offset=5 * N).reshape(N, L, K)
    return meta, ids.astype(dtype.newbyteorder("="))
