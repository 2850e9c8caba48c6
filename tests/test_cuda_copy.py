"""experts/transfer/cuda_copy.py: the driver-API copies are used only where libcuda loads and not turned
off; on cuda they land where torch's copies would."""
import ctypes

import pytest
import torch

from freetoken.experts.transfer import cuda_copy


def test_no_libcuda_means_not_available(monkeypatch):
    def refuse(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(cuda_copy, "_lib", None)
    monkeypatch.setattr(ctypes, "CDLL", refuse)
    assert cuda_copy.available() is False
    with pytest.raises(cuda_copy.CudaError, match="libcuda is not available"):
        cuda_copy.Event()


@pytest.mark.gpu
def test_driver_copies_and_events_cuda():
    if not cuda_copy.available():
        pytest.skip("libcuda does not load")
    src = torch.randint(0, 255, (3, 4096 + 64), dtype=torch.uint8).pin_memory()
    dst = torch.zeros((4, 4096 + 128), dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    done = cuda_copy.Event()
    row = dst.stride(0)
    for s, e in ((3, 0), (1, 2)):
        cuda_copy.copy_htod(dst.data_ptr() + s * row, src.data_ptr() + e * src.stride(0),
                            src.shape[1], side.cuda_stream)
    done.record(side)
    torch.cuda.current_stream().wait_event(done)  # torch's wait_event calls done.wait(stream)
    got = dst.cpu()
    torch.cuda.synchronize()
    assert done.query()
    assert torch.equal(got[3, :src.shape[1]], src[0]) and torch.equal(got[1, :src.shape[1]], src[2])
    assert not got[0].any() and not got[2].any() and not got[:, src.shape[1]:].any()
