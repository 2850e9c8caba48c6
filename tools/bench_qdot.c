/* ns per 32-block of the quantized dot kernels alone (cython/qdot_impl.c: fp32, qdot8_impl.c:
 * int8), one thread, 64 rows of K = 2048 (in L2), 1 / 4 / 16 inputs, best of 200 passes: the
 * compute-bound rate of one core, which a shared VM's wall time hides. Built from the repo root:
 *
 *   gcc -O3 -fno-strict-aliasing -pthread -Icython tools/bench_qdot.c cython/qdot_impl.c \
 *       cython/qdot8_impl.c cython/ffn_dot_impl.c -lm -o /tmp/bench_qdot && /tmp/bench_qdot avx512
 *
 * The argument names the ISA path (generic, avx2, avx512; default avx2); the int8 kernels'
 * avx512 form is their avx512-vnni one, where the CPU has it (else avx2's).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "qdot.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    enum { K = 2048, NR = 64, NX = 16 };
    const char *isa_name = argc > 1 ? argv[1] : "avx2";
    const int isa = !strcmp(isa_name, "generic") ? FT_ISA_GENERIC : !strcmp(isa_name, "avx512") ? FT_ISA_AVX512 : FT_ISA_AVX2;
    if (!ft_isa_supported(isa)) {
        fprintf(stderr, "this CPU cannot run the %s path\n", isa_name);
        return 1;
    }
    printf("# fp32 path %d, int8 path %d (0 generic, 1 avx2, 2 avx512%s)\n", ft_qdot_isa(isa), ft_qdot8_isa(isa),
           ft_qdot8_has_vnni() ? "; int8: vnni" : "");
    const char *names[] = {"q8_0", "q4_0", "mxfp4"};
    const int nxs[] = {1, 4, 16};
    srand(1);
    for (int dt = FT_Q8_0; dt <= FT_MXFP4; dt++) {
        const int64_t rb = ft_qrow_bytes(dt, K), sb = ft_qrow_scale_bytes(dt, K), st = ft_xq_stride(K);
        uint8_t *w = malloc(NR * rb), *s = malloc(NR * sb), *xq = aligned_alloc(64, NX * st);
        float *x = malloc(NX * K * sizeof(float)), res[NR * NX];
        for (int i = 0; i < NR * rb; i++) w[i] = (uint8_t)rand();
        for (int i = 0; i < NR * sb; i++)  /* e8m0 near 2^-5; fp16 of magnitude < 2^-8 */
            s[i] = dt == FT_MXFP4 ? (uint8_t)(120 + rand() % 8) : (i & 1 ? 0x1c : (uint8_t)rand());
        const void *ws[NR], *ss[NR];
        const float *xs[NX];
        const uint8_t *xqs[NX];
        for (int r = 0; r < NR; r++) ws[r] = w + r * rb, ss[r] = s + r * sb;
        for (int i = 0; i < NX * K; i++) x[i] = rand() / (float)RAND_MAX - 0.5f;
        for (int j = 0; j < NX; j++) {
            xs[j] = x + j * K;
            ft_quantize_x8(xs[j], K, 0, K / FT_QBLOCK, dt, xq + j * st);
            xqs[j] = xq + j * st;
        }
        const ft_qdot_fn f = ft_qdot_select(isa, dt);
        const ft_qdot8_fn g = ft_qdot8_select(isa, dt);
        for (int n = 0; n < 3; n++)
            for (int path = 0; path < 2; path++) {
                double best = 1e9;
                for (int rep = 0; rep < 200; rep++) {
                    const double t0 = now();
                    for (int r = 0; r < NR; r += 4) {
                        if (path) g(ws + r, ss + r, 4, K, xqs, nxs[n], res, 0);
                        else f(ws + r, ss + r, NULL, 4, K, xs, nxs[n], res, 0);
                    }
                    const double t = now() - t0;
                    best = t < best ? t : best;
                }
                const double blocks = (double)NR * K / FT_QBLOCK;
                printf("%-6s inputs %2d %-5s %6.2f ns/block  %5.1f GB/s of the rows' bytes\n", names[dt - FT_Q8_0],
                       nxs[n], path ? "int8" : "fp32", best / blocks * 1e9, NR * (rb + sb) / best / 1e9);
            }
        free(w), free(s), free(xq), free(x);
    }
    return 0;
}
