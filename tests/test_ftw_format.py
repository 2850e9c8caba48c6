"""FTW format: SPEC.md vs constants, golden bytes, round trips, layout properties, determinism,
split files, verify, and bank loading (O_DIRECT and its buffered fallback)."""
import hashlib
import os
import random
import re
import struct
from pathlib import Path

import numpy as np
import pytest

import ftw
from ftw import constants as C
from ftw import writer
from conftest import refuse_o_direct_io
from ftw.errors import ChecksumError, PartFileError

SPEC = Path(ftw.__file__).parent / "SPEC.md"


def _experts(rng, num_experts, inter, hidden, dtype=np.float32):
    return [{"gate": rng.standard_normal((inter, hidden)).astype(dtype),
             "up": rng.standard_normal((inter, hidden)).astype(dtype),
             "down": rng.standard_normal((hidden, inter)).astype(dtype)} for _ in range(num_experts)]


def _tables(seed=0):
    rng = np.random.default_rng(seed)
    tensors = [writer.tensor_from_array("token_embd.weight", "fp32", rng.standard_normal((10, 8)).astype(np.float32)),
               writer.tensor_from_array("output_norm.weight", "fp16", rng.standard_normal(8).astype(np.float16)),
               writer.tensor_from_array("blk.0.attn_norm.weight", "bf16", rng.integers(0, 2**16, 8).astype(np.uint16)),
               writer.tensor_from_array("blk.10.attn_norm.weight", "fp32", rng.standard_normal(8).astype(np.float32)),
               writer.tensor_from_array("blk.2.attn_norm.weight", "fp32", rng.standard_normal(8).astype(np.float32))]
    banks = [writer.bank_from_arrays(0, "fp32", _experts(rng, 3, 6, 8)),
             writer.bank_from_arrays(2, "fp16", _experts(rng, 4, 5, 8, np.float16))]
    return tensors, banks


def _spec_value(name):
    m = re.search(rf"^\| `{name}` \| `([^`]+)`", SPEC.read_text(), re.M)
    assert m, f"SPEC.md has no constants row for {name}"
    return m.group(1)


def test_spec_matches_constants():
    assert int(_spec_value("VERSION")) == C.VERSION
    assert int(_spec_value("ALIGNMENT")) == C.ALIGNMENT
    assert int(_spec_value("PROJ_ALIGNMENT")) == C.PROJ_ALIGNMENT
    assert int(_spec_value("PREFIX_SIZE")) == C.PREFIX_SIZE == struct.calcsize("<4sIQII")
    assert int(_spec_value("PART_PREFIX_SIZE")) == C.PART_PREFIX_SIZE
    assert int(_spec_value("MAX_HEADER_LEN")) == C.MAX_HEADER_LEN
    assert bytes.fromhex(_spec_value("MAGIC")) == C.MAGIC
    assert bytes.fromhex(_spec_value("PART_MAGIC")) == C.PART_MAGIC
    text = SPEC.read_text()
    dtypes = dict(re.findall(r"^\| `(\w+)` \| (\d) \| ", text, re.M))
    assert {k: int(v) for k, v in dtypes.items()} == C.DTYPE_SIZES
    history = text.split("## Version history")[1].split("##")[0]
    versions = [int(v) for v in re.findall(r"^\| (\d+) \|", history, re.M)]
    assert versions[-1] == C.VERSION and C.VERSION in C.SUPPORTED_VERSIONS
    assert "## Rejected alternatives" in text


def test_golden_two_tensor_file(tmp_path):
    tensors = [writer.tensor_from_array("token_embd.weight", "fp32", np.arange(6, dtype=np.float32).reshape(2, 3)),
               writer.tensor_from_array("output_norm.weight", "fp16", np.array([1, -2, 0.5, 3], dtype=np.float16))]
    path = tmp_path / "g.ftw"
    writer.write(str(path), {"model.config": {"family": "test"}}, tensors, [])
    data = path.read_bytes()
    assert data[:24].hex() == "465457000100000060010000000000002060064c00000000"  # FTW\0, v1, 352 B, crc
    assert len(data) == 12288
    assert hashlib.sha256(data).hexdigest() == "320b85f1a744d98d5c7024340e4bf8132457c83838680e3ba43c0c59e149bd2c"
    with ftw.open(path, verify=True) as f:
        assert f.tensor("token_embd.weight").tolist() == [[0, 1, 2], [3, 4, 5]]
        assert f.tensor("output_norm.weight").tolist() == [1, -2, 0.5, 3]


def test_round_trip_and_layout(tmp_path):
    tensors, banks = _tables()
    path = tmp_path / "m.ftw"
    writer.write(str(path), {"k": [1, 2]}, tensors, banks, threads=3)
    with ftw.open(path, verify=True) as f:
        assert f.version == 1 and f.metadata == {"k": [1, 2]}  # nothing quantized: version 1 (SPEC.md §9.5)
        for t in tensors:
            assert f.tensor_bytes(t.name).tobytes() == np.ascontiguousarray(t.read()[0]).tobytes()
        for b in banks:
            info = f.banks[b.layer]
            es = C.DTYPE_SIZES[info.dtype]
            inter, hidden = b.inter_size, b.hidden_size
            # INTERFACES §3 slot layout
            assert [(p.name, p.shape, p.offset) for p in info.projections] == [
                ("gate", (inter, hidden), 0),
                ("up", (inter, hidden), C.round_up(inter * hidden * es, 64)),
                ("down", (hidden, inter), C.round_up(C.round_up(inter * hidden * es, 64) + inter * hidden * es, 64))]
            assert info.slot_stride % C.ALIGNMENT == 0
            assert info.slot_stride >= info.projections[-1].offset + info.projections[-1].nbytes
            for e in range(info.num_experts):
                slot = f.slot_bytes(b.layer, e)
                for p in info.projections:
                    assert slot[p.offset:p.offset + p.nbytes].tobytes() == b.read_expert(e)[p.name].tobytes()
                end = info.projections[-1].offset + info.projections[-1].nbytes
                assert not slot[end:].any(), "slot padding is zero"
        # aligned, inside the file, no overlap, in §7 order (tensors, then banks by layer)
        ranges = [(t.offset, t.nbytes, t.name) for t in f.tensors.values()]
        ranges += [(b.offset, b.nbytes, b.name) for b in f.banks.values()]
        assert all(off % C.ALIGNMENT == 0 for off, _, _ in ranges)
        ranges.sort()
        for (a, n, _), (b, _, _) in zip(ranges, ranges[1:]):
            assert a + n <= b
        assert ranges[-1][0] + ranges[-1][1] <= f.files[0]["data_size"]
        assert [r[2] for r in ranges] == ["output_norm.weight", "token_embd.weight", "blk.0.attn_norm.weight",
                                          "blk.2.attn_norm.weight", "blk.10.attn_norm.weight",
                                          "blk.0.ffn_exps", "blk.2.ffn_exps"]
        assert os.path.getsize(path) == f.data_offset + f.files[0]["data_size"]


def test_same_input_same_bytes_in_any_order(tmp_path):
    tensors, banks = _tables()
    writer.write(str(tmp_path / "a.ftw"), {"b": 1, "a": 2}, tensors, banks, threads=1)
    random.Random(1).shuffle(tensors)
    writer.write(str(tmp_path / "c.ftw"), {"a": 2, "b": 1},
                 tensors, banks[::-1], threads=4)
    a, c = (tmp_path / "a.ftw").read_bytes(), (tmp_path / "c.ftw").read_bytes()
    # files[0].name differs ("a.ftw" vs "c.ftw") by one byte; every other byte is equal
    assert len(a) == len(c) and sum(x != y for x, y in zip(a[24:], c[24:])) == 1


def test_verify_finds_a_flipped_data_byte(tmp_path):
    tensors, banks = _tables()
    path = tmp_path / "m.ftw"
    writer.write(str(path), {}, tensors, banks)
    with ftw.open(path) as f:
        where = f.data_offset + f.banks[2].offset + f.banks[2].slot_stride + 3  # expert 1 of layer 2
    raw = bytearray(path.read_bytes())
    raw[where] ^= 0x10
    path.write_bytes(raw)
    ftw.open(path).close()  # the header is fine: data checks are on request
    with pytest.raises(ChecksumError, match="blk.2.ffn_exps expert 1"):
        ftw.open(path, verify=True)


def test_split_files(tmp_path):
    tensors, banks = _tables()
    path = tmp_path / "s.ftw"
    plan = writer.write(str(path), {}, tensors, banks, split_size=5 * C.ALIGNMENT)
    assert len(plan.files) > 2
    for f in plan.files:
        assert (tmp_path / f["name"]).stat().st_size <= 5 * C.ALIGNMENT
    writer.write(str(tmp_path / "one.ftw"), {}, tensors, banks)
    with ftw.open(path, verify=True) as s, ftw.open(tmp_path / "one.ftw") as one:
        for name in one.tensors:
            assert s.tensor_bytes(name).tobytes() == one.tensor_bytes(name).tobytes()
        loaded = s.load_banks(threads=2)
        for layer in one.banks:
            assert loaded[layer].data.tobytes() == one.load_banks()[layer].data.tobytes()
    (tmp_path / plan.files[-1]["name"]).unlink()
    with pytest.raises(PartFileError, match="missing"):
        ftw.open(path)


def _check_loaded(f, loaded, calls):
    assert sorted(loaded) == sorted(f.banks)
    assert [id(a) for a in calls] == [id(loaded[layer].data) for layer in sorted(f.banks)]
    for layer, hb in loaded.items():
        info = f.banks[layer]
        assert hb.info == info
        assert hb.data.dtype == np.uint8 and hb.data.nbytes == info.num_experts * info.slot_stride
        assert hb.data.ctypes.data % 4096 == 0
        for e in range(info.num_experts):
            assert hb.data[e * info.slot_stride:(e + 1) * info.slot_stride].tobytes() == f.slot_bytes(layer, e).tobytes()


@pytest.mark.parametrize("direct", [True, False])
def test_load_banks(tmp_path, direct):
    tensors, banks = _tables()
    writer.write(str(tmp_path / "m.ftw"), {}, tensors, banks)
    calls = []
    with ftw.open(tmp_path / "m.ftw") as f:
        _check_loaded(f, f.load_banks(threads=3, direct=direct, register=calls.append), calls)


def test_load_banks_falls_back_when_o_direct_is_refused(tmp_path, monkeypatch):
    tensors, banks = _tables()
    writer.write(str(tmp_path / "m.ftw"), {}, tensors, banks)
    # like a filesystem that opens with O_DIRECT but refuses the reads
    direct_fds = refuse_o_direct_io(monkeypatch, "preadv")
    calls = []
    with ftw.open(tmp_path / "m.ftw") as f:
        _check_loaded(f, f.load_banks(threads=2, register=calls.append), calls)
    if hasattr(os, "O_DIRECT"):
        assert direct_fds, "O_DIRECT was tried first"


def test_reader_never_imports_torch():
    import subprocess
    import sys
    code = ("import sys, ftw, ftw.reader, ftw.loading, ftw.inspect, ftw.writer\n"
            "assert 'torch' not in sys.modules, 'ftw imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)
