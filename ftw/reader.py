"""Read FTW files (SPEC.md): validate the whole header before trusting it (header.py), then hand
out numpy views of tensors, verify checksums, and load expert banks (loading.py).

numpy only; never imports torch (the engine wraps the buffers itself, docs/INTERFACES.md §4).
"""
from __future__ import annotations

import io
import mmap
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import numpy as np

from . import constants as C
from .errors import ChecksumError, FTWError
from .header import BankInfo, ProjInfo, TensorInfo, ValidatedHeader  # noqa: F401 - re-exported
from .loading import HostBank, load_banks  # noqa: F401 - HostBank re-exported


def open(path, verify: bool = False) -> "FTWFile":  # noqa: A001 - ftw.open mirrors builtins.open
    """Open and validate an FTW file; `verify=True` also checks every data checksum."""
    f = FTWFile(path)
    if verify:
        try:
            f.verify()
        except BaseException:
            f.close()
            raise
    return f


class FTWFile:
    """A validated FTW file. Safe to read from several threads; close() when done."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self._maps: dict = {}
        h = ValidatedHeader(self.path)  # every check of SPEC.md §7, before anything is trusted
        self.version, self.header_len, self.header_crc32 = h.version, h.header_len, h.header_crc32
        self.metadata, self.files, self.paths = h.metadata, h.files, h.paths
        self.data_offset, self.tensors, self.banks = h.data_offset, h.tensors, h.banks

    # --- data access ----------------------------------------------------------------------
    @property
    def config(self) -> dict:
        return self.metadata.get(C.KEY_CONFIG, {})

    @property
    def tokenizer_json(self) -> Optional[str]:
        return self.metadata.get(C.KEY_TOKENIZER_JSON)

    @property
    def chat_template(self) -> Optional[str]:
        return self.metadata.get(C.KEY_CHAT_TEMPLATE)

    def _map(self, file: int) -> mmap.mmap:
        m = self._maps.get(file)
        if m is None:
            with io.open(self.paths[file], "rb") as fp:
                m = mmap.mmap(fp.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[file] = m
        return m

    def _bytes(self, file: int, offset: int, nbytes: int) -> np.ndarray:
        start = self.files[file]["data_offset"] + offset
        return np.frombuffer(self._map(file), dtype=np.uint8, count=nbytes, offset=start)

    def tensor_bytes(self, name: str) -> np.ndarray:
        """Read-only uint8 view of exactly the tensor's bytes."""
        t = self.tensors[name]
        return self._bytes(t.file, t.offset, t.nbytes)

    def tensor(self, name: str) -> np.ndarray:
        """Read-only typed view with the tensor's shape (bf16 as uint16 bits); a quantized tensor
        (SPEC.md §9) has no such view: read tensor_bytes() and ftw.quant.dequantize them."""
        t = self.tensors[name]
        if t.quant != C.QUANT_NONE:
            raise FTWError(f"{name} is quantized ({t.quant}); read tensor_bytes({name!r}) and "
                           "dequantize them with ftw.quant.dequantize")
        return self.tensor_bytes(name).view(C.NUMPY_DTYPES[t.dtype]).reshape(t.shape)

    def slot_bytes(self, layer: int, expert: int) -> np.ndarray:
        b = self.banks[layer]
        return self._bytes(b.file, b.offset + expert * b.slot_stride, b.slot_stride)

    def verify(self, threads: Optional[int] = None) -> None:
        """Check every tensor and slot crc32 (SPEC.md §5); raises ChecksumError naming the first bad one."""
        jobs = [(t.name, t.file, t.offset, t.nbytes, t.crc32) for t in self.tensors.values()]
        for b in self.banks.values():
            jobs += [(f"{b.name} expert {e}", b.file, b.offset + e * b.slot_stride, b.slot_stride, c)
                     for e, c in enumerate(b.slot_crc32)]

        def check(job):
            name, file, offset, nbytes, want = job
            return name if zlib.crc32(self._bytes(file, offset, nbytes)) != want else None

        with ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1)) as pool:
            bad = [n for n in pool.map(check, jobs) if n is not None]
        if bad:
            more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
            raise ChecksumError(f"{self.path}: checksum mismatch in {bad[0]}{more}; the file is "
                                "corrupted, re-convert or re-copy it")

    def load_banks(self, threads: Optional[int] = None, direct: bool = True,
                   register: Optional[Callable] = None) -> dict:
        """Read every bank into its own exact-size, page-aligned anonymous buffer.

        Several threads issue O_DIRECT preadv calls of LOAD_CHUNK bytes straight into the final
        buffers (no staging copy); where the filesystem refuses O_DIRECT (EINVAL, e.g. tmpfs) the
        same reads go through the page cache. `register(data)` runs once per bank after its
        fill, in layer order, on the calling thread (the engine passes cudaHostRegister).
        """
        return load_banks(self, threads=threads, direct=direct, register=register)

    def close(self) -> None:
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # numpy views still alive: the map closes when they go
                pass
        self._maps = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
