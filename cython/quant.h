/* Quantizers of fp32 [rows, cols] tensors into ftw/SPEC.md §9's q8_0, q4_0, mxfp4 and nvfp4
 * regions: ftw/quant.py's reference quantize(), natively and byte for byte (quant_impl.c says
 * why each step is exact). No allocation, no threads, no Python: cython/quant.pyx calls them
 * with the GIL released, so convert's writer threads quantize side by side.
 *
 * x holds nblocks whole blocks back to back (32 elements; nvfp4 16): a row-major [rows, cols]
 * tensor with cols a multiple of the block is exactly that. qs receives the element bytes
 * (nblocks * 32 int8 for q8_0, nblocks * 16 bytes of nibbles for the 4-bit types; nvfp4
 * nblocks * 8), scales one scale per block (q8_0 / q4_0: 2 bytes, fp16 little-endian; mxfp4:
 * e8m0; nvfp4: e4m3), g (nvfp4) the fp32 tensor scale, little-endian.
 *
 * Each returns FTQ_OK, or FTQ_ASK_REFERENCE where it does not reproduce the reference: a NaN
 * or inf in x (the reference raises), or a block whose reference bytes come from numpy
 * casting inf / NaN to an integer (platform-defined; only blocks whose largest magnitude is
 * below ~1e-37, or an nvfp4 tensor whose largest is below ~2e-42). qs and scales are then
 * partly written and must be discarded.
 */
#ifndef FTQ_QUANT_H
#define FTQ_QUANT_H

#include <stdint.h>

#define FTQ_OK 0
#define FTQ_ASK_REFERENCE 1

int ftq_quantize_q8_0(const float *x, int64_t nblocks, uint8_t *qs, uint8_t *scales);
int ftq_quantize_q4_0(const float *x, int64_t nblocks, uint8_t *qs, uint8_t *scales);
int ftq_quantize_mxfp4(const float *x, int64_t nblocks, uint8_t *qs, uint8_t *scales);
int ftq_quantize_nvfp4(const float *x, int64_t nblocks, uint8_t *qs, uint8_t *scales, uint8_t *g);

#endif
