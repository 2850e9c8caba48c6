"""Read a Hugging Face safetensors checkpoint without loading it: index every tensor (single
file, sharded via model.safetensors.index.json, or all *.safetensors), then pread byte ranges
from any thread and convert dtypes elementwise (bf16 round-to-nearest-even done in numpy).

Parses the safetensors header itself (u64 length + JSON), so reads are plain os.pread calls
that release the GIL, and truncated files are caught before any work starts.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import BadSafetensorsError, MissingShardError, SourceNotFoundError, UnsupportedDtypeError

# safetensors dtype -> FTW dtype code
SOURCE_DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
_ELEM = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
         "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
READ_CHUNK = 8 << 20  # bytes per read of a non-expert tensor (the writer streams them through 8 MiB buffers)


@dataclass(frozen=True)
class SourceTensor:
    name: str
    file: str          # path of the .safetensors file
    st_dtype: str      # safetensors dtype string (BF16, F32, I8, ...)
    shape: tuple
    start: int         # absolute byte offset in the file
    nbytes: int

    @property
    def dtype(self):
        """FTW dtype code, or None when unsupported."""
        return SOURCE_DTYPES.get(self.st_dtype)


def index_checkpoint(src: Path) -> dict:
    """{hf_name: SourceTensor} for every tensor of the checkpoint in `src`."""
    index_path = src / "model.safetensors.index.json"
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise BadSafetensorsError(f"{index_path} is not a valid safetensors index (no weight_map)") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (src / f).is_file()]
        if missing:
            raise MissingShardError(f"{len(missing)} shard(s) listed in {index_path.name} are missing: "
                                    f"{', '.join(missing[:5])}; download the complete checkpoint")
    elif (src / "model.safetensors").is_file():
        weight_map, files = None, ["model.safetensors"]
    else:
        files = sorted(p.name for p in src.glob("*.safetensors"))
        weight_map = None
        if not files:
            raise SourceNotFoundError(f"no *.safetensors weights in {src}; freetoken converts "
                                      "Hugging Face safetensors checkpoints")
    tensors = {}
    for fname in files:
        for t in read_header(src / fname):
            if weight_map is not None and weight_map.get(t.name) != fname:
                continue  # the index decides which shard owns a name
            if t.name in tensors:
                raise BadSafetensorsError(f"tensor {t.name} appears in two files ({Path(tensors[t.name].file).name}, "
                                          f"{fname}); the checkpoint is inconsistent")
            tensors[t.name] = t
    if weight_map is not None:
        lost = sorted(set(weight_map) - set(tensors))
        if lost:
            raise BadSafetensorsError(f"{len(lost)} tensor(s) of {index_path.name} are not in their shard "
                                      f"(e.g. {lost[0]} in {weight_map[lost[0]]}); re-download that shard")
    return tensors


def read_header(path: Path) -> list:
    """The SourceTensors of one .safetensors file, checked to lie inside the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise BadSafetensorsError(f"{path.name} is truncated ({size} bytes); re-download it")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 << 20:
            raise BadSafetensorsError(f"{path.name} is truncated or not a safetensors file (header of "
                                      f"{n} bytes in a {size}-byte file); re-download it")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError:
        raise BadSafetensorsError(f"{path.name} has a malformed header; re-download it") from None
    base = 8 + n
    out = []
    for name, info in sorted(header.items()):
        if name == "__metadata__":
            continue
        try:
            st_dtype, shape = info["dtype"], tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise BadSafetensorsError(f"{path.name}: bad header entry for {name}; re-download it") from None
        if base + end > size or begin > end:
            raise BadSafetensorsError(f"{path.name} is truncated: {name} ends at byte {base + end} of "
                                      f"{size}; re-download it")
        if st_dtype in _ELEM and end - begin != int(np.prod(shape, dtype=np.int64)) * _ELEM[st_dtype]:
            raise BadSafetensorsError(f"{path.name}: {name} has {end - begin} bytes for {st_dtype} "
                                      f"{list(shape)}; re-download it")
        out.append(SourceTensor(name, str(path), st_dtype, shape, base + begin, end - begin))
    return out


def check_dtypes(tensors) -> None:
    bad = sorted((t for t in tensors if t.dtype is None), key=lambda t: t.name)
    if bad:
        kinds = sorted({t.st_dtype for t in bad})
        raise UnsupportedDtypeError(
            f"{len(bad)} tensor(s) are {'/'.join(kinds)} (e.g. {bad[0].name}); freetoken convert "
            "reads bf16, fp16 and fp32 checkpoints (and FP8 weights with 128 x 128 weight_scale_inv "
            "blocks, gpt-oss's MXFP4 experts): use the unquantized release of this model")


class Reader:
    """Thread-safe pread access to the source files (one fd per file, opened on first use)."""

    def __init__(self):
        self._fds = {}

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:  # a race opens a file twice at worst; both fds are closed in close()
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            old = self._fds.setdefault(path, fd)
            if old != fd:
                os.close(fd)
                fd = old
        return fd

    def read(self, t: SourceTensor, start: int = 0, nbytes: int | None = None) -> bytearray:
        out = bytearray(t.nbytes - start if nbytes is None else nbytes)
        self.read_into(t, memoryview(out), start)
        return out

    def read_into(self, t: SourceTensor, out: memoryview, start: int = 0) -> None:
        """Fill `out` with t's bytes [start, start + len(out)) (no allocation, no copy)."""
        fd, done, nbytes = self._fd(t.file), 0, len(out)
        while done < nbytes:
            n = os.preadv(fd, [out[done:]], t.start + start + done)
            if n == 0:
                raise BadSafetensorsError(f"{Path(t.file).name} ended while reading {t.name}; re-download it")
            done += n

    def prefetch(self, t: SourceTensor, start: int = 0, nbytes: int | None = None) -> None:
        """Ask the OS to start reading t's bytes [start, start + nbytes) into the page cache."""
        nbytes = t.nbytes - start if nbytes is None else nbytes
        try:
            os.posix_fadvise(self._fd(t.file), t.start + start, nbytes, os.POSIX_FADV_WILLNEED)
        except (AttributeError, OSError):  # a hint: no fadvise here, or the fs ignores it
            pass

    def array(self, t: SourceTensor, dtype: str, start: int = 0, nbytes: int | None = None) -> np.ndarray:
        """Elements [start, start + nbytes) bytes of t converted to `dtype` (flat)."""
        return convert_dtype(np.frombuffer(self.read(t, start, nbytes), dtype=_np(t.dtype)), t.dtype, dtype)

    def chunks(self, t: SourceTensor, dtype: str):
        for a in range(0, t.nbytes, READ_CHUNK):
            yield self.array(t, dtype, a, min(READ_CHUNK, t.nbytes - a))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


def _np(code: str):
    return {"bf16": np.uint16, "fp16": np.float16, "fp32": np.float32}[code]


def convert_dtype(a: np.ndarray, src: str, dst: str) -> np.ndarray:
    """Convert elementwise; bf16 is carried as uint16 bits (little-endian)."""
    if src == dst:
        return a
    f32 = (a.astype(np.uint32) << 16).view(np.float32) if src == "bf16" else a.astype(np.float32)
    if dst == "fp32":
        return f32
    if dst == "fp16":
        return f32.astype(np.float16)
    return fp32_to_bf16(f32)


def fp32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even to bf16 bits (uint16); NaN stays a quiet NaN, overflow goes to inf."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x0040).astype(np.uint16)
    return rounded
