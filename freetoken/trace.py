"""Routing traces: which experts every token was routed to, in every MoE layer (issue 6).

Owns the trace file and its writer/reader; needs only numpy and json (no torch), so
`tools/replay_cache.py` can study traces anywhere. Replaying them is not done here.

    meta = {"family": "qwen3_moe", "num_layers": 4, "moe_layers": [0, 1, 2, 3],
            "num_experts": 16, "top_k": 2, "prompt": "def f(x):", "num_prompt_tokens": 5}
    with TraceWriter("run.npz", meta) as w:        # or w = TraceWriter(...); ...; w.close()
        w.add_step(ids_prefill, "prefill")         # ids [T, L, K] ints, L = len(moe_layers)
        w.add(ids_token, "decode")                 # ids [L, K]: one token
    meta, ids = read_trace("run.npz")              # ids np.int16 (int32 if E > 32767) [N, L, K]
    meta["phases"]  # np.uint8 [N]: index into PHASES, 0 prefill / 1 decode
    meta["steps"]   # np.uint32 [N]: which add/add_step call (forward step) each token came from

Arrays may be numpy arrays or CPU torch tensors (anything np.asarray takes). The writer buffers
in memory (a 10k-token trace of 48 layers x top-8 is 7.7 MB) and writes on close(): first to
`<path>.partial`, then renames, so a crashed run never leaves a truncated trace behind.

The file is numpy's own container (numpy.savez_compressed, read with allow_pickle=False),
whatever its name; it holds four arrays:
    version  u32 []         VERSION
    meta     str []         JSON of the writer's meta (family, moe_layers, prompt, ...)
    phases   u8  [N]        index into PHASES
    steps    u32 [N]        forward step of each token
    ids      i16/i32 [N, L, K]
read_trace adds num_tokens, ids_dtype and shape ([N, L, K]) to the meta it returns.
"""
from __future__ import annotations

import json
import os
import zipfile
import zlib

import numpy as np

from .errors import FreetokenError

VERSION = 2  # 1 was a zstd frame behind a JSON header (.fttrace), before numpy's container
PHASES = ("prefill", "decode")
_REQUIRED = ("num_layers", "moe_layers", "num_experts", "top_k")
_ARRAYS = ("version", "meta", "phases", "steps", "ids")


class TraceError(FreetokenError):
    """A trace file or trace record is malformed (not a trace, wrong version, shape, expert id)."""


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
        L, K = self.shape
        ids = np.concatenate(self._ids) if self._ids else np.zeros((0, L, K), self.dtype)
        phases = np.concatenate(self._phases) if self._phases else np.zeros(0, np.uint8)
        steps = np.concatenate(self._steps) if self._steps else np.zeros(0, np.uint32)
        partial = self.path + ".partial"
        # a file object, not a name: savez would append ".npz" to a name that lacks it
        with open(partial, "wb") as f:
            np.savez_compressed(f, version=np.uint32(VERSION), phases=phases, steps=steps, ids=ids,
                                meta=np.str_(json.dumps(self.meta, sort_keys=True)))
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
    try:
        npz = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise TraceError(f"{path} does not exist; check the path") from None
    except (OSError, EOFError, ValueError, zipfile.BadZipFile) as exc:
        raise TraceError(_not_loadable(path, exc)) from None
    if not isinstance(npz, np.lib.npyio.NpzFile) or not set(npz.files) >= set(_ARRAYS):
        raise TraceError(f"{path} is not a freetoken trace (not an .npz holding {', '.join(_ARRAYS)}): "
                         "pass a file written by --trace-out")
    with npz:
        try:
            version = int(npz["version"])
            if version != VERSION:
                raise TraceError(f"{path} is trace version {version}; this freetoken reads version {VERSION}")
            meta = json.loads(str(npz["meta"]))
            phases, steps, ids = npz["phases"], npz["steps"], npz["ids"]
        except (OSError, EOFError, ValueError, TypeError, zipfile.BadZipFile, zlib.error) as exc:
            raise TraceError(f"{path} is a damaged or truncated trace ({exc}): record it again") from None
    N = ids.shape[0] if ids.ndim == 3 else -1
    if (N < 0 or ids.dtype not in (np.int16, np.int32) or phases.shape != (N,) or steps.shape != (N,)
            or phases.dtype != np.uint8 or steps.dtype != np.uint32 or not isinstance(meta, dict)):
        raise TraceError(f"{path} is a damaged trace (ids {ids.dtype} {list(ids.shape)}, phases "
                         f"{phases.dtype} {list(phases.shape)}, steps {steps.dtype} {list(steps.shape)}): "
                         "record it again")
    meta.update(num_tokens=N, ids_dtype=ids.dtype.name, shape=list(ids.shape), phases=phases, steps=steps)
    return meta, ids


def _not_loadable(path, exc) -> str:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        head = b""
    if head == b"FTTRACE\0":
        return f"{path} is a version 1 trace (.fttrace), which this freetoken no longer reads: record it again"
    if head.startswith(b"PK"):  # a zip's first bytes; numpy's ValueError would speak of pickles
        detail = "its zip is cut short" if isinstance(exc, ValueError) else exc
        return f"{path} is a damaged or truncated trace ({detail}): record it again"
    return f"{path} is not a freetoken trace (not an .npz file): pass a file written by --trace-out"
