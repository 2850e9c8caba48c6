"""FTW layout (SPEC.md §3, §5, §6, §7): the entries a writer is handed, where each one goes,
and the header JSON. Pure arithmetic over sizes: no file I/O, no Hugging Face.

    plan = plan_layout(metadata, tensors, banks, split_size)   # every offset, before any data
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import numpy as np

from . import constants as C
from .errors import FTWError, SplitSizeError
from .hf_source import convert_dtype
from .quant import quant_nbytes, quantize

CRC_PLACEHOLDER = "00000000"


@dataclass
class TensorEntry:
    """One non-expert tensor. `read()` yields its bytes (already in `dtype`, or a `quant` type's
    SPEC.md §9.2 bytes) in order, in chunks of any size. `prefetch()`, when given, asks the OS to
    start reading the source early."""
    name: str
    dtype: str
    shape: tuple
    read: Callable[[], Iterable]
    prefetch: Optional[Callable[[], None]] = None
    quant: str = C.QUANT_NONE

    @property
    def nbytes(self) -> int:
        if self.quant != C.QUANT_NONE:
            return quant_nbytes(self.quant, self.shape)
        return int(np.prod(self.shape, dtype=np.int64)) * C.DTYPE_SIZES[self.dtype]


@dataclass
class BankEntry:
    """One MoE layer's experts. `read_expert(e)` returns {"gate": [I, D], "up": [I, D], "down": [D, I]}
    numpy arrays whose bytes are already in `dtype` (bf16 as uint16 bits); a quantized bank
    (`quant`, SPEC.md §9) returns each weight projection's §9.2 bytes (uint8, `quant_nbytes`
    long; biases stay `dtype` arrays, SPEC.md §5.2), and its slot sizes follow from the quant type.

    Optional fast paths: `read_expert_into(e, views)` fills the same {"gate", "up", "down"} arrays
    in place (views into the writer's slot buffer, so source bytes can be read straight into it);
    `prefetch(e)` asks the OS to start reading expert e's source bytes (called ahead of the fill).
    """
    layer: int
    dtype: str
    num_experts: int
    inter_size: int   # I
    hidden_size: int  # D
    read_expert: Callable[[int], dict]
    read_expert_into: Optional[Callable[[int, dict], None]] = None
    prefetch: Optional[Callable[[int], None]] = None
    quant: str = C.QUANT_NONE
    has_bias: bool = False  # the slot also holds gate_bias [I], up_bias [I], down_bias [D]
    projections: tuple = field(init=False)
    slot_stride: int = field(init=False)

    def __post_init__(self):
        es = C.DTYPE_SIZES[self.dtype]
        I, D = self.inter_size, self.hidden_size
        shapes = {"gate": (I, D), "up": (I, D), "down": (D, I),
                  "gate_bias": (I,), "up_bias": (I,), "down_bias": (D,)}
        names = C.BANK_PROJECTIONS + (C.BIAS_PROJECTIONS if self.has_bias else ())
        projs, pos = [], 0
        for name in names:  # SPEC.md §5.2 slot layout
            pos = C.round_up(pos, C.PROJ_ALIGNMENT)
            if self.quant != C.QUANT_NONE and name not in C.BIAS_PROJECTIONS:  # §9.2: blocks and scales together
                nbytes = quant_nbytes(self.quant, shapes[name])
            else:
                nbytes = int(np.prod(shapes[name])) * es
            projs.append({"name": name, "shape": list(shapes[name]), "offset": pos, "nbytes": nbytes})
            pos += nbytes
        self.projections = tuple(projs)
        self.slot_stride = C.round_up(pos, C.ALIGNMENT)

    @property
    def nbytes(self) -> int:
        return self.num_experts * self.slot_stride


@dataclass
class Plan:
    header: dict          # with placeholder checksums
    header_len: int
    version: int          # the lowest that holds the file (SPEC.md §9.5)
    files: list           # [{"name", "data_offset", "data_size"}]
    placed: list          # [(entry, file_index, offset)] in data order


def tensor_sort_key(name: str):
    """Global tensors first, then blk.0.*, blk.1.*, ... (layer compared as an integer) (§7)."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 1 and parts[1].isdigit():
        return (1, int(parts[1]), name)
    return (0, 0, name)


def dumps(obj) -> bytes:
    """Canonical JSON bytes of the header (§3)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def plan_layout(metadata: dict, tensors: list, banks: list, split_size: Optional[int] = None,
                name: str = "model.ftw") -> Plan:
    """Place every entry (§7 order) and build the header with placeholder checksums."""
    entries = sorted(tensors, key=lambda t: tensor_sort_key(t.name)) + sorted(banks, key=lambda b: b.layer)
    names = [t.name for t in tensors]
    if len(set(names)) != len(names) or len({b.layer for b in banks}) != len(banks):
        raise FTWError("internal: duplicate tensor name or bank layer handed to the writer")
    data_offset = C.round_up(C.PREFIX_SIZE + 2, C.ALIGNMENT)
    for _ in range(16):  # the header length depends on the part count, which depends on data_offset
        files, placed = _assign_files(entries, data_offset, split_size, name)
        header = build_header(metadata, files, placed)
        header_len = len(dumps(header))
        needed = C.round_up(C.PREFIX_SIZE + header_len, C.ALIGNMENT)
        if needed == data_offset:  # data_offset is exactly round_up(prefix + header) (§3)
            return Plan(header, header_len, file_version(entries), files, placed)
        data_offset = needed
    raise FTWError("internal: header layout did not converge")  # pragma: no cover


def _assign_files(entries, data_offset, split_size, name):
    cap = None if split_size is None else split_size - data_offset
    files = [{"name": name, "data_offset": data_offset, "data_size": 0}]
    placed, used = [], 0
    for entry in entries:
        size = C.round_up(entry.nbytes, C.ALIGNMENT)
        if cap is not None and used + size > cap:
            part_cap = split_size - C.PART_PREFIX_SIZE
            if size > part_cap:
                raise SplitSizeError(
                    f"--split-size {split_size} bytes is smaller than {_entry_name(entry)} "
                    f"({size} bytes with its header/alignment); use a --split-size of at least "
                    f"{size + C.PART_PREFIX_SIZE} bytes")
            # a new part (an empty part always has room: size <= part_cap)
            files.append({"name": f"{name}.part{len(files)}", "data_offset": C.PART_PREFIX_SIZE,
                          "data_size": 0})
            used, cap = 0, part_cap
        placed.append((entry, len(files) - 1, used))
        used += size
        files[-1]["data_size"] = used
    return files, placed


def _entry_name(entry) -> str:
    return entry.name if isinstance(entry, TensorEntry) else C.bank_name(entry.layer)


def file_version(entries) -> int:
    """1 when nothing is quantized (older readers keep reading the file), else 2 (SPEC.md §9.5)."""
    return 2 if any(e.quant != C.QUANT_NONE for e in entries) else 1


def build_header(metadata, files, placed, crcs=None) -> dict:
    tensors, banks = [], []
    quant_keys = file_version([entry for entry, _, _ in placed]) >= 2  # `quant` exists from version 2
    for i, (entry, file_index, offset) in enumerate(placed):
        if isinstance(entry, TensorEntry):
            crc = CRC_PLACEHOLDER if crcs is None else f"{crcs[i]:08x}"
            tensors.append({"name": entry.name, "dtype": entry.dtype, "shape": list(entry.shape),
                            "file": file_index, "offset": offset, "nbytes": entry.nbytes, "crc32": crc})
            if quant_keys:
                tensors[-1]["quant"] = entry.quant
        else:
            slot_crcs = ([CRC_PLACEHOLDER] * entry.num_experts if crcs is None
                         else [f"{c:08x}" for c in crcs[i]])
            banks.append({"layer": entry.layer, "name": C.bank_name(entry.layer), "dtype": entry.dtype,
                          "file": file_index, "offset": offset, "num_experts": entry.num_experts,
                          "slot_stride": entry.slot_stride, "projections": list(entry.projections),
                          "slot_crc32": slot_crcs})
            if quant_keys:
                banks[-1]["quant"] = entry.quant
    return {"metadata": metadata, "files": files, "tensors": tensors, "banks": banks}


def tensor_from_array(name: str, dtype: str, array: np.ndarray, quant: str = C.QUANT_NONE) -> TensorEntry:
    """A TensorEntry over an in-memory array whose bytes are already in `dtype` (tests, tools);
    with `quant`, an fp32 [rows, cols] array quantized with ftw.quant (SPEC.md §9.4)."""
    if quant != C.QUANT_NONE:
        data = np.frombuffer(quantize(array, quant), dtype=np.uint8)
        return TensorEntry(name, dtype, tuple(array.shape), lambda: [data], quant=quant)
    array = np.ascontiguousarray(array)
    if array.itemsize != C.DTYPE_SIZES[dtype]:
        raise FTWError(f"array for {name} has {array.itemsize}-byte elements, not {dtype}")
    return TensorEntry(name, dtype, tuple(array.shape), lambda: [array])


def bank_from_arrays(layer: int, dtype: str, experts: list, quant: str = C.QUANT_NONE) -> BankEntry:
    """A BankEntry over in-memory [{"gate", "up", "down"}] arrays (tests, tools), with
    "gate_bias", "up_bias", "down_bias" too for a biased bank; with `quant`, fp32 arrays whose
    weights are quantized with ftw.quant (SPEC.md §9.4) and whose biases are cast to `dtype`."""
    inter, hidden = experts[0]["gate"].shape
    has_bias = "gate_bias" in experts[0]
    if quant != C.QUANT_NONE:
        experts = [{k: (convert_dtype(np.asarray(a, np.float32), "fp32", dtype) if k in C.BIAS_PROJECTIONS
                        else np.frombuffer(quantize(a, quant), dtype=np.uint8))
                    for k, a in ex.items()} for ex in experts]
    return BankEntry(layer, dtype, len(experts), inter, hidden, lambda e: experts[e], quant=quant,
                     has_bias=has_bias)
