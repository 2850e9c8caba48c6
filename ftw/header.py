"""Validate an FTW header (SPEC.md §2-§7) before anything trusts it: prefix, checksum, JSON
schema, files and parts, every offset, size, alignment and overlap. Each failure is a named
error (errors.py) whose message says what is wrong and what to do. Reads no tensor data.
"""
from __future__ import annotations

import io
import json
import os
import struct
import zlib
from dataclasses import dataclass

from . import constants as C
from .errors import (AlignmentError, BadMagicError, HeaderChecksumError, HeaderError, OutOfFileError,
                     OverlapError, PartFileError, PartNameError, QuantShapeError, SizeMismatchError,
                     TruncatedFileError, UnknownQuantError, UnsupportedVersionError)
from .quant import quant_nbytes


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple
    offset: int       # from the data section of files[file] (SPEC.md §5.1)
    nbytes: int
    crc32: int
    file: int = 0
    quant: str = C.QUANT_NONE  # SPEC.md §9; "none" in every version 1 file


@dataclass(frozen=True)
class ProjInfo:
    name: str         # gate | up | down
    shape: tuple
    offset: int       # inside the slot
    nbytes: int


@dataclass(frozen=True)
class BankInfo:
    layer: int
    name: str
    offset: int       # from the data section of files[file] (SPEC.md §5.2)
    num_experts: int
    slot_stride: int
    dtype: str
    projections: tuple
    slot_crc32: tuple
    file: int = 0
    quant: str = C.QUANT_NONE  # SPEC.md §9; "none" in every version 1 file

    @property
    def nbytes(self) -> int:
        return self.num_experts * self.slot_stride


class ValidatedHeader:
    """Everything the header of the FTW file at `path` says, checked: version, header_len,
    header_crc32, metadata, files, paths (of files[k]), data_offset, tensors {name: TensorInfo},
    banks {layer: BankInfo}. Raises an FTWFormatError subclass on the first failed check."""

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            fobj = io.open(self.path, "rb")
        except FileNotFoundError:
            raise TruncatedFileError(f"{self.path} does not exist; check the path") from None
        with fobj:
            size = os.fstat(fobj.fileno()).st_size
            prefix = fobj.read(C.PREFIX_SIZE)
            self._check_prefix(prefix, size)
            raw = fobj.read(self.header_len)
        if zlib.crc32(raw) != self.header_crc32:
            raise HeaderChecksumError(f"{self.path}: the header checksum does not match (the file "
                                      "is corrupted or was edited); re-convert or re-copy it")
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise HeaderError(f"{self.path}: the header is not valid JSON ({e}); re-convert the model") from None
        self._parse(header, size)

    def _check_prefix(self, prefix: bytes, size: int) -> None:
        p = self.path
        if len(prefix) >= 4 and prefix[:4] != C.MAGIC:
            raise BadMagicError(f"{p} is not an FTW file (it starts with {prefix[:4]!r}, not "
                                f"{C.MAGIC!r}); convert a model with `freetoken convert`")
        if len(prefix) < C.PREFIX_SIZE:
            raise TruncatedFileError(f"{p} is truncated ({size} bytes); re-convert or re-copy it")
        _, self.version, self.header_len, self.header_crc32, reserved = struct.unpack("<4sIQII", prefix)
        if self.version not in C.SUPPORTED_VERSIONS:
            raise UnsupportedVersionError(
                f"{p} is FTW format version {self.version}; this freetoken reads versions "
                f"{', '.join(map(str, C.SUPPORTED_VERSIONS))}: upgrade freetoken or re-convert the model")
        if reserved != 0:
            raise HeaderError(f"{p}: reserved prefix field is {reserved}, not 0; the file is corrupted")
        if not 2 <= self.header_len <= C.MAX_HEADER_LEN:
            raise HeaderError(f"{p}: header length {self.header_len} is out of range; the file is corrupted")
        if C.PREFIX_SIZE + self.header_len > size:
            raise TruncatedFileError(f"{p} is truncated: its header needs {C.PREFIX_SIZE + self.header_len} "
                                     f"bytes but the file has {size}; re-convert or re-copy it")

    def _parse(self, h, main_size: int) -> None:
        g = _Getter(self.path)
        g.obj(h, "header")
        self.metadata = g.obj(g.key(h, "metadata", "header"), "metadata")
        files = g.list(g.key(h, "files", "header"), "files")
        if not files:
            raise HeaderError(f"{self.path}: header lists no files; re-convert the model")
        self.files = []
        for k, f in enumerate(files):
            where = f"files[{k}]"
            g.obj(f, where)
            self.files.append({"name": g.str(g.key(f, "name", where), where + ".name"),
                               "data_offset": g.uint(g.key(f, "data_offset", where), where),
                               "data_size": g.uint(g.key(f, "data_size", where), where)})
        self.data_offset = C.round_up(C.PREFIX_SIZE + self.header_len, C.ALIGNMENT)
        if self.files[0]["data_offset"] != self.data_offset:
            raise HeaderError(f"{self.path}: data offset {self.files[0]['data_offset']} should be "
                              f"{self.data_offset}; the file is corrupted")
        for k, f in enumerate(self.files[1:], 1):
            self._check_part_name(k, f["name"])
        self.paths = [self.path] + [os.path.join(os.path.dirname(self.path), f["name"]) for f in self.files[1:]]
        for k, f in enumerate(self.files):
            if f["data_offset"] % C.ALIGNMENT or f["data_size"] % C.ALIGNMENT:
                raise AlignmentError(f"{self.path}: files[{k}] data section is not {C.ALIGNMENT}-aligned")
            self._check_file(k, main_size)
        self.tensors = {}
        for i, t in enumerate(g.list(g.key(h, "tensors", "header"), "tensors")):
            info = self._tensor(g, t, f"tensors[{i}]")
            if info.name in self.tensors:
                raise HeaderError(f"{self.path}: tensor {info.name} is listed twice; re-convert the model")
            self.tensors[info.name] = info
        self.banks = {}
        for i, b in enumerate(g.list(g.key(h, "banks", "header"), "banks")):
            info = self._bank(g, b, f"banks[{i}]")
            if info.layer in self.banks:
                raise HeaderError(f"{self.path}: layer {info.layer} has two expert banks; re-convert the model")
            self.banks[info.layer] = info
        self._check_overlaps()

    def _check_part_name(self, k: int, name: str) -> None:
        """Part k is looked up beside the main file (SPEC.md §3), so its name must be a bare file
        name: joined to the main file's folder it can name no other folder."""
        what = None
        if not name:
            what = "is empty"
        elif "\0" in name:
            what = "holds a NUL byte"
        elif name[0] in "/\\" or os.path.splitdrive(name)[0]:  # splitdrive: "C:" on Windows
            what = "is an absolute path"
        elif "/" in name or "\\" in name:  # both separators on every OS: a name means one file
            what = "holds a path separator"
        elif name in (".", ".."):
            what = "names a folder"
        if what is not None:
            raise PartNameError(f"{self.path}: files[{k}].name {name!r} {what}; part names must be "
                                "bare file names beside the main file: re-convert the model")

    def _check_file(self, k: int, main_size: int) -> None:
        f, p = self.files[k], self.paths[k]
        if k == 0:
            size = main_size
        else:
            try:
                size = os.path.getsize(p)
                with io.open(p, "rb") as fp:
                    pp = fp.read(20)
            except OSError:
                raise PartFileError(f"part file {p} of {self.path} is missing; copy all "
                                    f"{len(self.files)} files of the model together") from None
            want = struct.pack("<4sIIII", C.PART_MAGIC, self.version, k, len(self.files), self.header_crc32)
            if pp != want:
                raise PartFileError(f"{p} is not part {k} of {self.path} (its part prefix does not "
                                    "match the header); copy the parts from the same conversion")
        need = f["data_offset"] + f["data_size"]
        if size < need:
            raise TruncatedFileError(f"{p} is truncated: the header needs {need} bytes, the file has "
                                     f"{size}; re-convert or re-copy it")

    def _tensor(self, g, t, where) -> TensorInfo:
        g.obj(t, where)
        name = g.str(g.key(t, "name", where), where + ".name")
        where = f"tensor {name}"
        dtype = g.dtype(g.key(t, "dtype", where), where)
        shape = g.shape(g.key(t, "shape", where), where)
        file = g.file(g.key(t, "file", where), where, len(self.files))
        offset = g.uint(g.key(t, "offset", where), where)
        nbytes = g.uint(g.key(t, "nbytes", where), where)
        crc = g.crc(g.key(t, "crc32", where), where)
        quant = self._quant(g, t, where)
        want = self._nbytes(where, dtype, quant, shape)
        if nbytes != want:
            raise SizeMismatchError(f"{self.path}: {where} has {nbytes} bytes but {_kind(dtype, quant)} x "
                                    f"{list(shape)} needs {want}; the file is corrupted, re-convert it")
        self._check_range(where, file, offset, nbytes)
        return TensorInfo(name, dtype, shape, offset, nbytes, crc, file, quant)

    def _quant(self, g, obj, where) -> str:
        """The entry's quant type: "none" in version 1 (a `quant` key there is not ours to read),
        required from version 2 (SPEC.md §9.5); an unknown type is refused by name."""
        if self.version < 2:
            return C.QUANT_NONE
        quant = g.str(g.key(obj, "quant", where), where + ".quant")
        if quant != C.QUANT_NONE and quant not in C.QUANT_TYPES:
            raise UnknownQuantError(
                f"{self.path}: {where} is quantized as {quant!r}, a type this freetoken does not know "
                f"(it knows {', '.join(C.QUANT_TYPES)}): upgrade freetoken or re-convert the model "
                "with a known --quant")
        return quant

    def _nbytes(self, where, dtype, quant, shape) -> int:
        if quant == C.QUANT_NONE:
            return _prod(shape) * C.DTYPE_SIZES[dtype]
        try:
            return quant_nbytes(quant, shape)
        except QuantShapeError as e:
            raise QuantShapeError(f"{self.path}: {where}: {e}; the file is corrupted, re-convert it") from None

    def _bank(self, g, b, where) -> BankInfo:
        g.obj(b, where)
        layer = g.uint(g.key(b, "layer", where), where)
        where = f"bank of layer {layer}"
        name = g.str(g.key(b, "name", where), where)
        dtype = g.dtype(g.key(b, "dtype", where), where)
        file = g.file(g.key(b, "file", where), where, len(self.files))
        offset = g.uint(g.key(b, "offset", where), where)
        num_experts = g.uint(g.key(b, "num_experts", where), where)
        stride = g.uint(g.key(b, "slot_stride", where), where)
        crcs = tuple(g.crc(c, where) for c in g.list(g.key(b, "slot_crc32", where), where))
        quant = self._quant(g, b, where)
        if num_experts < 1 or len(crcs) != num_experts:
            raise HeaderError(f"{self.path}: {where} has {num_experts} experts and {len(crcs)} slot "
                              "checksums; the file is corrupted, re-convert it")
        if stride == 0 or stride % C.ALIGNMENT:
            raise AlignmentError(f"{self.path}: {where} slot stride {stride} is not a positive "
                                 f"multiple of {C.ALIGNMENT}; re-convert the model")
        projs, end = [], 0
        for j, p in enumerate(g.list(g.key(b, "projections", where), where)):
            pw = f"{where} projection {j}"
            g.obj(p, pw)
            pname = g.str(g.key(p, "name", pw), pw)
            shape = g.shape(g.key(p, "shape", pw), pw)
            poff = g.uint(g.key(p, "offset", pw), pw)
            pbytes = g.uint(g.key(p, "nbytes", pw), pw)
            pquant = C.QUANT_NONE if pname in C.BIAS_PROJECTIONS else quant  # biases stay dtype (§5.2)
            if pbytes != self._nbytes(f"{where} {pname}", dtype, pquant, shape):
                raise SizeMismatchError(f"{self.path}: {where} {pname} has {pbytes} bytes, not "
                                        f"{_kind(dtype, quant)} x {list(shape)}; re-convert the model")
            if poff % C.PROJ_ALIGNMENT:
                raise AlignmentError(f"{self.path}: {where} {pname} offset {poff} is not "
                                     f"{C.PROJ_ALIGNMENT}-aligned; re-convert the model")
            if poff < end or poff + pbytes > stride:
                raise OverlapError(f"{self.path}: {where} {pname} overlaps another projection or "
                                   "runs past the slot; the file is corrupted, re-convert it")
            end = poff + pbytes
            projs.append(ProjInfo(pname, shape, poff, pbytes))
        names = tuple(p.name for p in projs)
        if names not in (C.BANK_PROJECTIONS, C.BANK_PROJECTIONS + C.BIAS_PROJECTIONS):
            raise HeaderError(f"{self.path}: {where} has projections {list(names)}, expected "
                              f"{list(C.BANK_PROJECTIONS)} (+ {list(C.BIAS_PROJECTIONS)}); "
                              "re-convert the model")
        self._check_range(where, file, offset, num_experts * stride)
        return BankInfo(layer, name, offset, num_experts, stride, dtype, tuple(projs), crcs, file, quant)

    def _check_range(self, where: str, file: int, offset: int, nbytes: int) -> None:
        if offset % C.ALIGNMENT:
            raise AlignmentError(f"{self.path}: {where} offset {offset} is not {C.ALIGNMENT}-aligned; "
                                 "the file is corrupted, re-convert it")
        size = self.files[file]["data_size"]
        if offset + nbytes > size:
            raise OutOfFileError(f"{self.path}: {where} ends at byte {offset + nbytes} of a "
                                 f"{size}-byte data section; the file is corrupted, re-convert it")

    def _check_overlaps(self) -> None:
        ranges = [(t.file, t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values()]
        ranges += [(b.file, b.offset, b.offset + b.nbytes, b.name) for b in self.banks.values()]
        ranges.sort()
        for a, b in zip(ranges, ranges[1:]):
            if a[0] == b[0] and b[1] < a[2]:
                raise OverlapError(f"{self.path}: {a[3]} and {b[3]} overlap; the file is corrupted, "
                                   "re-convert it")


def _kind(dtype: str, quant: str) -> str:
    return dtype if quant == C.QUANT_NONE else quant


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _Getter:
    """Typed access to header JSON; every mismatch is a HeaderError naming the key."""

    def __init__(self, path):
        self.path = path

    def fail(self, where, what):
        raise HeaderError(f"{self.path}: {where}: {what}; the file is corrupted or from an "
                          "incompatible converter, re-convert the model")

    def key(self, obj, key, where):
        if key not in obj:
            self.fail(where, f"missing key {key!r}")
        return obj[key]

    def obj(self, v, where):
        return v if isinstance(v, dict) else self.fail(where, "expected an object")

    def list(self, v, where):
        return v if isinstance(v, list) else self.fail(where, "expected a list")

    def str(self, v, where):
        return v if isinstance(v, str) else self.fail(where, "expected a string")

    def uint(self, v, where):
        ok = isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63
        return v if ok else self.fail(where, f"expected a non-negative integer, got {v!r}")

    def file(self, v, where, num_files):
        v = self.uint(v, where)
        return v if v < num_files else self.fail(where, f"file index {v} but only {num_files} files")

    def dtype(self, v, where):
        if v not in C.DTYPE_SIZES:
            self.fail(where, f"unknown dtype {v!r} (known: {', '.join(C.DTYPE_SIZES)})")
        return v

    def shape(self, v, where):
        self.list(v, where)
        if not 1 <= len(v) <= 4:
            self.fail(where, f"shape {v} must have 1 to 4 dims")
        return tuple(self.uint(d, where) if d else self.fail(where, "zero-sized dim") for d in v)

    def crc(self, v, where):
        ok = isinstance(v, str) and len(v) == 8 and all(c in "0123456789abcdef" for c in v)
        return int(v, 16) if ok else self.fail(where, f"bad crc32 {v!r}")
