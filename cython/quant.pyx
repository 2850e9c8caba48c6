# cython: language_level=3, boundscheck=False, wraparound=False
"""ftw/quant.py's quantize() for q8_0, q4_0, mxfp4 and nvfp4, natively (freetoken._quant).

Private: only ftw/quant.py imports this module, and only when it is built (ftw works without
it). quantize answers the same bytes as the reference or None: None for what the C code does
not reproduce (cython/quant.h: a NaN or inf, blocks whose reference bytes are numpy's casts of
inf / NaN), and the reference then decides (or raises). The C code runs with the GIL released,
so convert's writer threads quantize in parallel.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport int64_t, uint8_t
from libc.string cimport memset
cimport numpy as cnp

cnp.import_array()


cdef extern from "quant.h" nogil:
    int FTQ_OK
    int ftq_quantize_q8_0(const float *x, int64_t nblocks, uint8_t *qs, uint8_t *scales)
    int ftq_quantize_q4_0(const float *x, int64_t nblocks, uint8_t *qs, uint8_t *scales)
    int ftq_quantize_mxfp4(const float *x, int64_t nblocks, uint8_t *qs, uint8_t *scales)
    int ftq_quantize_nvfp4(const float *x, int64_t nblocks, uint8_t *qs, uint8_t *scales,
                           uint8_t *g)


# quant -> (block elements, element bytes per block, scale bytes per block)
QUANTS = {"q8_0": (32, 32, 2), "q4_0": (32, 16, 2), "mxfp4": (32, 16, 1), "nvfp4": (16, 8, 1)}


def quantize(x, str quant, r):
    """x: fp32 [r.rows, r.cols], C-contiguous and aligned; r: ftw.quant.Regions of `quant` (one of
    QUANTS). Returns the bytes of the quantized tensor (regions as r says, the padding zero), or
    None where ftw/quant.py must answer."""
    block, qs_per, scale_per = QUANTS[quant]
    if not (cnp.PyArray_Check(x) and cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT32
            and cnp.PyArray_NDIM(x) == 2 and cnp.PyArray_ISCARRAY_RO(x)
            and cnp.PyArray_ISNOTSWAPPED(x)):
        raise ValueError("quantize takes an aligned, C-contiguous, native-order fp32 2-D array")
    cdef cnp.ndarray xa = <cnp.ndarray>x
    cdef int64_t rows = cnp.PyArray_DIMS(xa)[0], cols = cnp.PyArray_DIMS(xa)[1]
    cdef int64_t nblocks = rows * cols // block
    cdef int64_t qs_nbytes = nblocks * qs_per
    cdef int64_t scales_offset = r.scales_offset, nbytes = r.nbytes
    cdef int64_t scales_end = scales_offset + nblocks * scale_per
    cdef int64_t g_offset = nbytes if r.tensor_scale_offset is None else r.tensor_scale_offset
    if (r.quant != quant or (rows, cols) != (r.rows, r.cols) or cols % block
            or qs_nbytes != r.qs_nbytes or scales_offset < qs_nbytes or scales_end > g_offset
            or g_offset + (4 if quant == "nvfp4" else 0) != nbytes):
        raise ValueError(f"{quant} regions {r} do not fit an fp32 [{rows}, {cols}] tensor")
    out = PyBytes_FromStringAndSize(NULL, nbytes)  # not shared until returned: filled in place
    cdef uint8_t *o = <uint8_t *>PyBytes_AS_STRING(out)
    cdef const float *xs = <const float *>cnp.PyArray_DATA(xa)
    cdef int kind = ("q8_0", "q4_0", "mxfp4", "nvfp4").index(quant)  # no str compares in nogil
    cdef int status
    with nogil:
        memset(o + qs_nbytes, 0, scales_offset - qs_nbytes)
        memset(o + scales_end, 0, g_offset - scales_end)
        if kind == 0:
            status = ftq_quantize_q8_0(xs, nblocks, o, o + scales_offset)
        elif kind == 1:
            status = ftq_quantize_q4_0(xs, nblocks, o, o + scales_offset)
        elif kind == 2:
            status = ftq_quantize_mxfp4(xs, nblocks, o, o + scales_offset)
        else:
            status = ftq_quantize_nvfp4(xs, nblocks, o, o + scales_offset, o + g_offset)
    return out if status == FTQ_OK else None
