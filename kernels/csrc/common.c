/* What the library was built with (cpu_kernels_features) and the AMX switch the GEMM and prefill
 * attention share.
 *
 * AMX (Xeon Sapphire Rapids and later): eight tile registers of up to 16 rows x 64 bytes and a
 * multiply (tdpbf16ps) of bf16 tiles into fp32 ones. Linux gives a process the tiles only once it
 * asks (arch_prctl, 5.16+); amx_on() asks once, and batchgen_amx() switches their use off and on
 * (BATCHGEN_AMX=0, kernels/cpu_native.py). The bf16 GEMM (gemm.c) uses them; without, its
 * vector code runs. (Decode attention on tiles was tried: on 2 Xeon cores it reads its keys and
 * values at ~13 GB/s either way, bound by memory, not arithmetic, so it stays vector code. Tried
 * again with the spread L2 stream, its scores only, keys straight from the cache as A tiles: 30
 * layers of 16 sequences in L2 2.3-2.4 against 2.8 ms, but 128 sequences from DRAM 38.6-40.7
 * against 38.1-39.8 ms.) */
#include "kernels.h"

#if HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>

static int amx_state = -1; /* -1 not asked yet, 0 refused or switched off, 1 in use */

int amx_on(void) {
    if (amx_state < 0) /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
        amx_state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_state;
}

void amx_shapes(const int rows[8], const int colsb[8]) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } c __attribute__((aligned(64)));
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = (uint8_t)rows[t];
        c.colsb[t] = (uint16_t)(rows[t] ? colsb[t] : 0);
    }
    /* GCC 12 does not count ldtilecfg's 64-byte read as a use of c and may drop the stores above
     * (seen: only the palette byte written, then a #GP on the garbage): make them happen first */
    __asm__ __volatile__("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}
#else
int amx_on(void) { return 0; }

void amx_shapes(const int rows[8], const int colsb[8]) { (void)rows, (void)colsb; }
#endif

/* Whether the kernels use AMX tiles: enable 1 (asking Linux for them once) or 0 switches, -1 only
 * asks; returns 1 when they do (built with AMX, tiles granted, switched on). */
int batchgen_amx(int enable) {
#if HAVE_AMX
    if (enable == 0) amx_state = 0;
    else if (enable == 1 && amx_state == 0) amx_state = -1;
    return enable == 0 ? 0 : amx_on();
#else
    (void)enable;
    return 0;
#endif
}

/* What this build's kernels use: 1 AVX-512, 2 AVX2 (without AVX-512), 4 AVX512-BF16's vdpbf16ps (the
 * tiled bf16 prefill), 8 a panel GEMM for fp32 (gemm.c: AVX-512 or AVX2), 16 one for bf16
 * (vdpbf16ps or AMX tiles; with AVX2 widened to fp32 in registers). */
int cpu_kernels_features(void) {
#if defined(__AVX512BF16__)
    const int dp = HAVE_AVX512 ? 4 : 0;
#else
    const int dp = 0;
#endif
    const int gemm_bf16 = dp || HAVE_AVX2 ? 16 : 0;
    return (HAVE_AVX512 ? 1 : 0) | (HAVE_AVX2 ? 2 : 0) | dp | (HAVE_SIMD ? 8 : 0) | gemm_bf16;
}
