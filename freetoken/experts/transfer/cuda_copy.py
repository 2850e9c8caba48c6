"""Host-to-device copies and events straight through the CUDA driver API (libcuda, ctypes), for
the decode step's fills: one cuMemcpyHtoDAsync per fill and one event, about a microsecond of
host time each, where torch's copy_ + Event + stream context cost tens of microseconds per fill.
The copies run on the GPU's copy engines, which take less host memory bandwidth from the CPU
expert kernel than a kernel reading mapped host memory, but cost more host time per layer than
the zero-copy gather (docs/MEASUREMENTS.md#fills-zero-copy-gather-vs-copy-engine).

Handles are torch's: a torch.cuda.Stream's cuda_stream is the driver's CUstream. The calling
thread must have the device's primary context current, which torch's first CUDA call makes.
"""
import ctypes
import ctypes.util


_lib = None  # libcuda, loaded on first use; False when it is not there


def _driver():
    global _lib
    if _lib is None:
        name = ctypes.util.find_library("cuda") or "libcuda.so.1"
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            _lib = False
            return None
        vp, sz, u = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
        for fn, args in (("cuMemcpyHtoDAsync_v2", (ctypes.c_uint64, vp, sz, vp)),
                         ("cuEventCreate", (ctypes.POINTER(vp), u)),
                         ("cuEventRecord", (vp, vp)),
                         ("cuEventQuery", (vp,)),
                         ("cuEventDestroy_v2", (vp,)),
                         ("cuStreamWaitEvent", (vp, vp, u))):
            f = getattr(lib, fn)
            f.argtypes, f.restype = args, ctypes.c_int
        _lib = lib
    return _lib or None


def available() -> bool:
    """Whether libcuda loads (without it, fills.py keeps torch's copies)."""
    return _driver() is not None


class CudaError(RuntimeError):
    pass


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise CudaError(f"{what} failed with CUDA driver error {rc}")


def copy_htod(dst_ptr: int, src_ptr: int, nbytes: int, stream: int) -> None:
    """Queue a copy of nbytes from host address src_ptr (pinned, else the driver stages it and
    the call returns only when the source was read) to device address dst_ptr on `stream`."""
    _check(_lib.cuMemcpyHtoDAsync_v2(dst_ptr, src_ptr, nbytes, stream), "cuMemcpyHtoDAsync")


def _handle(stream) -> int:
    return stream if isinstance(stream, int) else stream.cuda_stream


class Event:
    """A driver event without timing (the cheapest kind): record on one stream, wait on another."""

    def __init__(self):
        self.handle = None
        if _driver() is None:
            raise CudaError("libcuda is not available")
        h = ctypes.c_void_p()
        _check(_lib.cuEventCreate(ctypes.byref(h), 2), "cuEventCreate")  # CU_EVENT_DISABLE_TIMING
        self.handle = h.value

    def record(self, stream) -> None:
        """stream: a CUstream handle or a torch.cuda.Stream."""
        _check(_lib.cuEventRecord(self.handle, _handle(stream)), "cuEventRecord")

    def wait(self, stream) -> None:
        """Make `stream` (a handle or a torch.cuda.Stream) wait, GPU-side, for the work before
        the last record. torch's Stream.wait_event(e) calls e.wait(stream): it takes these too."""
        _check(_lib.cuStreamWaitEvent(_handle(stream), self.handle, 0), "cuStreamWaitEvent")

    def query(self) -> bool:
        """Whether the work before the last record has finished (no wait)."""
        rc = _lib.cuEventQuery(self.handle)
        if rc == 600:  # CUDA_ERROR_NOT_READY
            return False
        _check(rc, "cuEventQuery")
        return True

    def __del__(self):
        if getattr(self, "handle", None) and _lib:
            _lib.cuEventDestroy_v2(self.handle)
            self.handle = None
