"""experts/vmm.py: SlotMemory on cuda (bytes kept across grows and shrinks at one address, the
driver's free memory following the mapped chunks, a CUDA graph captured over it still right
after resizes, the mapping alive while a tensor over it is); the cpu checks: the reasons it
gives without a driver API, and the cache's fallback to a plain tensor, said in the plan."""
import gc
import weakref

import pytest
import torch

from freetoken.experts import cache as cache_mod, vmm

MiB = 1 << 20


def test_unavailable_reasons_and_the_fallback(monkeypatch):
    assert vmm.unavailable_reason("cpu") == "not on cuda"
    assert cache_mod.create_slot_memory({}, 0, "cpu") == (None, "")
    monkeypatch.setattr(vmm, "_lib", None)
    monkeypatch.setattr(vmm, "_lib_error", None)

    def no_driver(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(vmm.ctypes, "CDLL", no_driver)
    why = vmm.unavailable_reason("cuda")
    assert why.startswith("no CUDA driver virtual memory API (libcuda.so.1: cannot open")
    memory, line = cache_mod.create_slot_memory({}, 0, "cuda")
    assert memory is None
    assert line == (f"expert cache slots reallocated at each resize ({why}): resizes capture the "
                    "decode graphs again")


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if vmm.unavailable_reason("cuda"):
        pytest.fail(f"the H200 host should have the VMM API: {vmm.unavailable_reason('cuda')}")


@pytest.mark.gpu
def test_slot_memory_keeps_its_bytes_and_address_across_resizes():
    _cuda()
    mem = vmm.SlotMemory("cuda", 64 * MiB, 5 * MiB, chunk_bytes=2 * MiB)
    chunk = mem.chunk
    assert chunk % mem.granularity == 0 and mem.max_bytes >= 64 * MiB
    assert mem.mapped == -(-5 * MiB // chunk) * chunk
    t = mem.tensor()
    assert t.data_ptr() == mem.ptr and t.numel() == mem.max_bytes and t.dtype == torch.uint8
    assert t.device == torch.device("cuda", torch.cuda.current_device())
    pattern = (torch.arange(5 * MiB, device="cuda") % 251).to(torch.uint8)
    t[:5 * MiB] = pattern
    free0 = torch.cuda.mem_get_info()[0]
    mem.resize(40 * MiB)
    free1 = torch.cuda.mem_get_info()[0]
    assert free0 - free1 >= (mem.mapped - 6 * MiB) // 2  # physical memory taken
    t[5 * MiB:40 * MiB] = 7
    assert torch.equal(t[:5 * MiB], pattern) and bool((t[5 * MiB:40 * MiB] == 7).all())
    mem.resize(3 * MiB)
    assert mem.mapped == -(-3 * MiB // chunk) * chunk
    assert torch.cuda.mem_get_info()[0] - free1 >= (40 * MiB - mem.mapped) // 2  # given back
    assert torch.equal(t[:3 * MiB], pattern[:3 * MiB])
    mem.resize(9 * MiB)
    assert torch.equal(t[:3 * MiB], pattern[:3 * MiB]) and t.data_ptr() == mem.ptr
    with pytest.raises(ValueError, match="do not fit"):
        mem.resize(mem.max_bytes + 1)


@pytest.mark.gpu
def test_a_graph_over_slot_memory_replays_right_after_resizes():
    """What the expert cache relies on: a graph captured over the slots reads and writes the
    same bytes after the tail was unmapped and mapped again."""
    _cuda()
    mem = vmm.SlotMemory("cuda", 32 * MiB, 8 * MiB, chunk_bytes=2 * MiB)
    words = mem.tensor()[:8 * MiB].view(torch.int32)  # [2M]
    words.zero_()
    idx = torch.tensor([0, 5, 1000], device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        words.index_add_(0, idx, torch.ones(3, dtype=torch.int32, device="cuda"))  # warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            words.index_add_(0, idx, torch.ones(3, dtype=torch.int32, device="cuda"))
    torch.cuda.current_stream().wait_stream(side)
    for size in (30 * MiB, 1 * MiB, 16 * MiB):
        mem.resize(size)
        graph.replay()
    torch.cuda.synchronize()
    assert words[idx].tolist() == [4, 4, 4]


@pytest.mark.gpu
def test_the_mapping_lives_as_long_as_a_tensor_over_it():
    _cuda()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    mem = vmm.SlotMemory("cuda", 256 * MiB, 200 * MiB)
    t = mem.tensor()
    ref = weakref.ref(mem)
    del mem
    gc.collect()
    assert ref() is not None  # the tensor holds it
    t[:200 * MiB].fill_(3)
    assert int(t[:200 * MiB].sum(dtype=torch.int64)) == 3 * 200 * MiB
    del t
    gc.collect()
    assert ref() is None
    torch.cuda.empty_cache()  # the sum's temporary (1.6 GB of int64) stays in torch's cache
    assert torch.cuda.mem_get_info()[0] >= free - 64 * MiB  # the chunks went back to the driver


def test_a_driver_that_refuses_the_memory_gives_the_fallback(monkeypatch):
    """cuMemCreate refused at start (an old driver, a device without VMM): the cache runs on a
    plain tensor, and the memory plan's line says why."""
    from types import SimpleNamespace
    infos = {0: SimpleNamespace(num_experts=8, slot_stride=4096)}
    monkeypatch.setattr(vmm, "unavailable_reason", lambda device: "")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=1 << 30))

    def refuse(device, max_bytes, nbytes):
        assert max_bytes == 8 * 4096 and nbytes == 3 * 4096  # every expert fits 1 GiB
        raise vmm.VmmError("cuMemCreate of 67108864 bytes failed: CUDA_ERROR_NOT_SUPPORTED "
                           "(CUresult 801)")
    monkeypatch.setattr(vmm, "SlotMemory", refuse)
    memory, line = cache_mod.create_slot_memory(infos, 3, "cuda")
    assert memory is None
    assert line == ("expert cache slots reallocated at each resize (cuMemCreate of 67108864 "
                    "bytes failed: CUDA_ERROR_NOT_SUPPORTED (CUresult 801)): resizes capture "
                    "the decode graphs again")
