/* What a build of the library was compiled for (ops/native.py logs it when it loads the kernels). */
#include "kernels.h"

/* The vector instruction sets this build was compiled for (ISA_* bits of contract.h), so the loader can tell a
 * build whose kernels use the AVX-512 forms they are written for from one that compiled their portable forms, and
 * whether those portable forms were vectorised for AVX2+FMA (x86-64-v3), the floor `--backend auto` asks for. */
int ds_vector_isa(void) {
    int isa = 0;
#if defined(__AVX512F__)
    isa |= ISA_AVX512F;
#endif
#if defined(__AVX512BF16__)
    isa |= ISA_AVX512BF16;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    isa |= ISA_AMX_BF16;
#endif
#if defined(__AVX2__)
    isa |= ISA_AVX2;
#endif
#if defined(__FMA__)
    isa |= ISA_FMA;
#endif
    return isa;
}
