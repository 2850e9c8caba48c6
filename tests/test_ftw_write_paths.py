"""FTW writer I/O paths: O_DIRECT, page cache and the fallback when a filesystem refuses direct
writes all give the same bytes; tensors streamed in odd chunks through the staging buffer;
prefetch hooks and the read-into fast path; bank memory of the loader."""
import os

import numpy as np
import pytest

import ftw
from ftw import loading, writer
from conftest import refuse_o_direct_io
from ftw.layout import BankEntry, TensorEntry


def _tables(seed=0):
    rng = np.random.default_rng(seed)
    tensors = [writer.tensor_from_array("token_embd.weight", "fp32", rng.standard_normal((300, 70)).astype(np.float32)),
               writer.tensor_from_array("output_norm.weight", "fp16", rng.standard_normal(70).astype(np.float16))]
    experts = [{"gate": rng.standard_normal((24, 70)).astype(np.float32),
                "up": rng.standard_normal((24, 70)).astype(np.float32),
                "down": rng.standard_normal((70, 24)).astype(np.float32)} for _ in range(5)]
    return tensors, [writer.bank_from_arrays(0, "fp32", experts), writer.bank_from_arrays(3, "fp32", experts[::-1])]


def test_direct_buffered_and_refused_direct_give_the_same_bytes(tmp_path, monkeypatch):
    tensors, banks = _tables()
    names = ("direct", "buffered", "refused")
    for n in names:
        (tmp_path / n).mkdir()
    writer.write(str(tmp_path / "direct" / "m.ftw"), {}, tensors, banks, threads=3)
    writer.write(str(tmp_path / "buffered" / "m.ftw"), {}, tensors, banks, threads=3, direct=False)
    # a filesystem that opens O_DIRECT but refuses the writes: the writer falls back per file
    direct_fds = refuse_o_direct_io(monkeypatch, "pwrite")
    writer.write(str(tmp_path / "refused" / "m.ftw"), {}, tensors, banks, threads=3)
    monkeypatch.undo()
    if hasattr(os, "O_DIRECT"):
        assert direct_fds, "O_DIRECT was tried first"
    raw = {n: (tmp_path / n / "m.ftw").read_bytes() for n in names}
    assert raw["buffered"] == raw["direct"] and raw["refused"] == raw["direct"]
    with ftw.open(tmp_path / "refused" / "m.ftw", verify=True) as f:
        assert f.tensor("token_embd.weight").tobytes() == tensors[0].read()[0].tobytes()


def test_tensor_chunks_of_any_size_cross_the_staging_buffer(tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "TENSOR_STAGE", 2 * 4096)
    data = np.random.default_rng(1).integers(0, 2**16, 30001, dtype=np.uint16)  # 60002 bytes

    def odd_chunks():
        for a in range(0, len(data), 777):
            yield data[a:a + 777]
    entry = TensorEntry("token_embd.weight", "bf16", (30001,), odd_chunks)
    writer.write(str(tmp_path / "m.ftw"), {}, [entry], [])
    with ftw.open(tmp_path / "m.ftw", verify=True) as f:
        assert np.array_equal(f.tensor("token_embd.weight"), data)
        end = f.data_offset + f.tensors["token_embd.weight"].nbytes
    assert not any((tmp_path / "m.ftw").read_bytes()[end:]), "tail padding is zero"


def test_prefetch_hooks_and_read_into_fast_path(tmp_path):
    tensors, banks = _tables()
    experts = [banks[0].read_expert(e) for e in range(banks[0].num_experts)]
    seen, filled = [], []

    def read_into(e, views):
        filled.append(e)
        for name, view in views.items():
            assert view.shape == experts[e][name].shape and view.dtype == np.float32
            view[...] = experts[e][name]

    def prefetch(e):
        seen.append(e)
        if e == 2:
            raise OSError("a hint that fails is ignored")
    fast = BankEntry(0, "fp32", len(experts), 24, 70, lambda e: pytest.fail("fast path not taken"),
                     read_into, prefetch)
    (tmp_path / "fast").mkdir()
    writer.write(str(tmp_path / "fast" / "m.ftw"), {}, tensors, [fast], threads=2)
    writer.write(str(tmp_path / "m.ftw"), {}, tensors, [banks[0]], threads=2)
    assert sorted(seen) == sorted(filled) == list(range(len(experts)))
    assert (tmp_path / "fast" / "m.ftw").read_bytes() == (tmp_path / "m.ftw").read_bytes()


def test_bank_memory_is_private_aligned_and_writable(tmp_path):
    tensors, banks = _tables()
    writer.write(str(tmp_path / "m.ftw"), {}, tensors, banks)
    with ftw.open(tmp_path / "m.ftw") as f:
        loaded = f.load_banks(threads=2)
    for layer, hb in loaded.items():
        assert hb.data.ctypes.data % 4096 == 0 and hb.data.flags.writeable
        assert hb.data.nbytes == f.banks[layer].nbytes
    buf = loading.alloc_bank(3 * 4096 + 5)
    assert len(buf) == 3 * 4096 + 5 and not any(buf[:])
