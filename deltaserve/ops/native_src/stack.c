/* A whole decoder stack's decode step in one call (layers/fused_stack.py): a program of the fused blocks of
 * blocks.c and AttnRes mixes over a register file of [N, D] bf16 row sets, run in order. At batch 1 the Python
 * around the ~30-60 block and mix calls of a step (argument checks, ctypes, output tensors) is a sizeable share
 * of the step; the calls and their order are the same, so the results are the blocks'.
 *
 * Each op is a record of int64 words [kind, length, ...] (layers/fused_stack.py writes them): registers are
 * indices into `regs` (-1: none), descriptors and cache pages are addresses.
 *   SOP_KDA x r out desc fdesc conv conv_stride rec rec_stride
 *   SOP_MLA x r out desc fdesc pages ld nrows pages_bf16
 *   SOP_DSA x r out desc fdesc pages ld nrows pages_bf16 keys ldk keys_bf16
 *   SOP_FFN x r out desc fdesc
 *   SOP_MIX out query norm_w eps_bits S src_0 .. src_{S-1}
 * The step's own inputs, shared by every op, are `step`: [STEP_SLOTS] the KDA state slots [N], [STEP_ROWS] the
 * sequences' cache rows [N, width] and [STEP_WIDTH], [STEP_WRITE] the new tokens' cache rows [N], [STEP_COS_SIN]
 * DeepSeek-V3.2's rotation at the tokens' positions (0: none). */
#include "kernels.h"

enum { SOP_KDA = 1, SOP_MLA, SOP_DSA, SOP_FFN, SOP_MIX };
enum { STEP_SLOTS, STEP_ROWS, STEP_WIDTH, STEP_WRITE, STEP_COS_SIN };
#define MAX_MIX_SOURCES 64

/* Returns 0, or 1 + the index of the op that failed (nothing after it ran): a cache row outside its pages, a
 * router shape the MoE block rejects, an unknown op or a mix of more than MAX_MIX_SOURCES sources. */
int64_t ds_decode_stack(const int64_t *program, int64_t nops, int64_t N, int64_t D, bf16 *regs, const int64_t *step,
                        int nthreads) {
#define REG(j) ((j) < 0 ? NULL : regs + (j) * N * D)
#define PTR(t, j) ((t)(intptr_t)(j))
    const int64_t *slots = PTR(const int64_t *, step[STEP_SLOTS]), *rows = PTR(const int64_t *, step[STEP_ROWS]);
    const int64_t *write = PTR(const int64_t *, step[STEP_WRITE]);
    const float *cos_sin = PTR(const float *, step[STEP_COS_SIN]);
    const int64_t *op = program;
    for (int64_t i = 0; i < nops; op += op[1], i++) {
        int failed = 0;
        switch (op[0]) {
        case SOP_KDA:
            ds_kda_block(PTR(const int64_t *, op[5]), PTR(const float *, op[6]), REG(op[2]), REG(op[3]), N, N, NULL,
                         slots, PTR(float *, op[7]), op[8], PTR(float *, op[9]), op[10], REG(op[4]), nthreads);
            break;
        case SOP_MLA:
            failed = ds_mla_block(PTR(const int64_t *, op[5]), PTR(const float *, op[6]), REG(op[2]), REG(op[3]), N,
                                  rows, step[STEP_WIDTH], write, PTR(void *, op[7]), op[8], op[9], (int)op[10],
                                  REG(op[4]), nthreads);
            break;
        case SOP_DSA:
            failed = ds_dsa_block(PTR(const int64_t *, op[5]), PTR(const float *, op[6]), REG(op[2]), REG(op[3]), N,
                                  rows, step[STEP_WIDTH], write, PTR(void *, op[7]), op[8], op[9], (int)op[10],
                                  PTR(void *, op[11]), op[12], (int)op[13], cos_sin, REG(op[4]), nthreads);
            break;
        case SOP_FFN:
            failed = ds_moe_block(PTR(const int64_t *, op[5]), PTR(const float *, op[6]), REG(op[2]), REG(op[3]), N,
                                  REG(op[4]), nthreads);
            break;
        case SOP_MIX: {
            int64_t S = op[6], src[MAX_MIX_SOURCES];
            float eps;
            int32_t bits = (int32_t)op[5];
            if (S < 1 || S > MAX_MIX_SOURCES) return i + 1;
            for (int64_t s = 0; s < S; s++) src[s] = (int64_t)(intptr_t)REG(op[7 + s]);
            memcpy(&eps, &bits, sizeof eps);
            ds_attn_res_mix(src, S, N, D, PTR(const bf16 *, op[4]), PTR(const bf16 *, op[3]), eps, REG(op[2]),
                            nthreads);
            break;
        }
        default:
            return i + 1;
        }
        if (failed) return i + 1;
    }
    return 0;
#undef REG
#undef PTR
}
