"""Device memory at a fixed address that grows and shrinks (cuda): SlotMemory reserves virtual
addresses once for the largest size and maps physical memory at the tail of the used part,
unmapping it again on a shrink. The expert cache keeps its slots in one (cache.py), so CUDA
graphs captured over the slots stay valid across resizes. It goes through the CUDA driver's
virtual memory management API via ctypes on libcuda.so.1 (no dependency); torch's caching
allocator never sees this memory. Not an allocator: one range, one owner.

    reserved  [0 ........................................ max_bytes)   virtual, reserved once
    mapped    [0 .... chunks * CHUNK)                                   physical, chunk by chunk
    used      [0 .. nbytes)                                             what the owner asked for

Physical memory is mapped in whole chunks (CHUNK_BYTES rounded up to the granularity): the
driver unmaps a mapping only whole, so a shrink to any size must find a mapping boundary at
or just above it. The tail past `nbytes` (less than a chunk) stays mapped.
"""
import ctypes
import threading

import torch

CHUNK_BYTES = 64 << 20  # one cuMemCreate each: 1000 of them map 64 GB

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class VmmError(RuntimeError):
    """A CUDA driver call of SlotMemory failed (the message names the call and the CUresult)."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", _Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_lib, _lib_error, _lock = None, None, threading.Lock()
_pending = []  # (device, ptr, max_bytes, chunk, handles) of memories collected during a capture


def _driver():
    """libcuda.so.1 with the calls' signatures, loaded once; raises VmmError when absent."""
    global _lib, _lib_error
    with _lock:
        if _lib is None and _lib_error is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
                u64, size, p = ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER
                sigs = {
                    "cuMemGetAllocationGranularity": [p(size), p(_AllocationProp), ctypes.c_int],
                    "cuMemAddressReserve": [p(u64), size, size, u64, u64],
                    "cuMemAddressFree": [u64, size],
                    "cuMemCreate": [p(u64), size, p(_AllocationProp), u64],
                    "cuMemRelease": [u64],
                    "cuMemMap": [u64, size, size, u64, u64],
                    "cuMemUnmap": [u64, size],
                    "cuMemSetAccess": [u64, size, p(_AccessDesc), size],
                    "cuCtxGetCurrent": [p(ctypes.c_void_p)],
                    "cuCtxSetCurrent": [ctypes.c_void_p],
                    "cuDevicePrimaryCtxRetain": [p(ctypes.c_void_p), ctypes.c_int],
                    "cuGetErrorName": [ctypes.c_int, p(ctypes.c_char_p)],
                }
                for name, args in sigs.items():
                    fn = getattr(lib, name)
                    fn.argtypes, fn.restype = args, ctypes.c_int
                _lib = lib
            except (OSError, AttributeError) as e:
                _lib_error = f"no CUDA driver virtual memory API ({e})"
        if _lib is None:
            raise VmmError(_lib_error)
        return _lib


def _check(rc: int, call: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _lib.cuGetErrorName(rc, ctypes.byref(name))
        text = name.value.decode() if name.value else "unknown"
        raise VmmError(f"{call} failed: {text} (CUresult {rc})")


class SlotMemory:
    """`max_bytes` of device addresses reserved at `ptr` on a cuda device, the first `nbytes`
    backed by physical memory. Contract: resize(n) maps or unmaps so that [0, n) is backed (the
    caller has finished every kernel reading a part it shrinks away: resize synchronizes the
    device before unmapping); tensor() views the whole reservation (uint8 [max_bytes], no copy)
    and keeps this object, hence the mapping, alive as long as it lives. Touching bytes past
    `mapped` faults the device. The reservation is given back when the last reference goes."""

    def __init__(self, device, max_bytes: int, nbytes: int = 0, chunk_bytes: int = CHUNK_BYTES):
        lib = _driver()
        _free_pending()
        self.device = torch.device(device)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        torch.cuda.init()
        self._make_current(lib, index)
        self._prop = _AllocationProp(type=_CU_MEM_ALLOCATION_TYPE_PINNED,
                                     location=_Location(_CU_MEM_LOCATION_TYPE_DEVICE, index))
        self._access = _AccessDesc(location=_Location(_CU_MEM_LOCATION_TYPE_DEVICE, index),
                                   flags=_CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        gran = ctypes.c_size_t()
        _check(lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(self._prop),
                                                 _CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
               "cuMemGetAllocationGranularity")
        self.granularity = gran.value
        self.chunk = -(-max(chunk_bytes, 1) // gran.value) * gran.value
        # at least one chunk: a tensor over it needs mapped memory at its start
        self.max_bytes = max(-(-max_bytes // self.chunk), 1) * self.chunk
        self.ptr, self.handles, self.nbytes = 0, [], 0
        ptr = ctypes.c_uint64()
        _check(lib.cuMemAddressReserve(ctypes.byref(ptr), self.max_bytes, 0, 0, 0),
               f"cuMemAddressReserve of {self.max_bytes} bytes")
        self.ptr = ptr.value
        self.resize(max(nbytes, 1))
        self.nbytes = nbytes

    @staticmethod
    def _make_current(lib, index: int) -> None:
        """The device's primary context current on this thread (torch's, made by torch)."""
        ctx = ctypes.c_void_p()
        _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), index),
                   "cuDevicePrimaryCtxRetain")
            _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    @property
    def mapped(self) -> int:
        """Bytes backed by physical memory (whole chunks, >= nbytes, at least one chunk)."""
        return len(self.handles) * self.chunk

    def resize(self, nbytes: int) -> None:
        """[0, nbytes) backed: chunks mapped at the tail (the new bytes are undefined) or the
        chunks wholly past it unmapped and released. VmmError when the driver refuses (out of
        memory: the chunks mapped before the failure stay, nbytes is unchanged)."""
        if not 0 <= nbytes <= self.max_bytes:
            raise ValueError(f"{nbytes} bytes do not fit the {self.max_bytes} reserved")
        lib = _driver()
        self._make_current(lib, self.device.index)
        want = max(-(-nbytes // self.chunk), 1)
        have = len(self.handles)
        if want < have:
            torch.cuda.synchronize(self.device)  # nothing queued still reads the tail
            while len(self.handles) > want:
                at = self.ptr + (len(self.handles) - 1) * self.chunk
                _check(lib.cuMemUnmap(at, self.chunk), "cuMemUnmap")
                _check(lib.cuMemRelease(self.handles.pop()), "cuMemRelease")
        elif want > have:
            try:
                while len(self.handles) < want:
                    handle = ctypes.c_uint64()
                    _check(lib.cuMemCreate(ctypes.byref(handle), self.chunk,
                                           ctypes.byref(self._prop), 0),
                           f"cuMemCreate of {self.chunk} bytes")
                    at = self.ptr + len(self.handles) * self.chunk
                    rc = lib.cuMemMap(at, self.chunk, 0, handle.value, 0)
                    if rc != 0:
                        lib.cuMemRelease(handle.value)
                        _check(rc, "cuMemMap")
                    self.handles.append(handle.value)
            finally:  # whatever got mapped is usable, so the owner may shrink it again
                if len(self.handles) > have:
                    at = self.ptr + have * self.chunk
                    _check(lib.cuMemSetAccess(at, (len(self.handles) - have) * self.chunk,
                                              ctypes.byref(self._access), 1), "cuMemSetAccess")
        self.nbytes = nbytes

    def tensor(self) -> torch.Tensor:
        """uint8 [max_bytes] over the reservation, no copy; it holds this object."""
        return torch.as_tensor(_ArrayInterface(self), device=self.device)

    def __del__(self):
        if _lib is None or not self.ptr:
            return
        _pending.append((self.device, self.ptr, self.max_bytes, self.chunk, self.handles))
        self.handles, self.ptr = [], 0
        _free_pending()


def _free_pending() -> None:
    """Give back the memories collected so far, unless a CUDA graph is being captured (the
    garbage collector may run inside a capture, where a synchronize would break it): then
    the next SlotMemory made or collected gives them back."""
    try:
        if torch.cuda.is_current_stream_capturing():
            return
        while _pending:
            device, ptr, max_bytes, chunk, handles = _pending.pop()
            torch.cuda.synchronize(device)  # no kernel still reads it
            for i in reversed(range(len(handles))):
                _lib.cuMemUnmap(ptr + i * chunk, chunk)
                _lib.cuMemRelease(handles[i])
            _lib.cuMemAddressFree(ptr, max_bytes)
    except Exception:  # at interpreter exit the driver may be gone already
        _pending.clear()


class _ArrayInterface:
    """__cuda_array_interface__ of a SlotMemory's reservation: torch.as_tensor keeps this object
    (and so the SlotMemory) alive as long as the tensor it makes."""

    def __init__(self, memory: SlotMemory):
        self.memory = memory
        self.__cuda_array_interface__ = {"shape": (memory.max_bytes,), "typestr": "|u1",
                                         "data": (memory.ptr, False), "version": 2,
                                         "strides": None}


def unavailable_reason(device) -> str:
    """Why SlotMemory cannot run on `device` ('' when it can): not cuda, or no driver API."""
    if torch.device(device).type != "cuda":
        return "not on cuda"
    try:
        _driver()
    except VmmError as e:
        return str(e)
    return ""
