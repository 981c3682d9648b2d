/* A run of a native program's ops in one call (backends/native/program.py): the fused blocks of blocks.c and
 * AttnRes mixes over a register file of [N, D] bf16 row sets, in order. At batch 1 the Python around the ~30-60
 * block and mix calls of a step (argument checks, ctypes, output tensors) is a sizeable share of the step; the calls
 * and their order are the same, so the results are the blocks'.
 *
 * Each op is a stack_op (contract.h): its kind (SOP_*), its registers (indices into `regs`, -1: none), the block's
 * descriptor and the fields of its layer's cache; a mix names its query, norm weight, eps and source registers. The
 * step's own inputs, shared by every op, are a stack_step: the sequences, their row offsets and KDA state slots, the
 * decode step's cache rows and new tokens' rows, DeepSeek-V3.2's rotation at the tokens' positions (NULL: none), and
 * the draft states a verify step keeps after its rows (NULL: none). */
#include "kernels.h"

/* Returns 0, or 1 + the index of the op that failed (nothing after it ran): a cache row outside its pages, a
 * router shape the MoE block rejects, an unknown op or a mix of more than MAX_MIX_SOURCES sources. */
int64_t ds_run_program(const stack_op *program, int64_t nops, int64_t N, int64_t D, bf16 *regs,
                        const stack_step *step, int nthreads) {
#define REG(j) ((j) < 0 ? NULL : regs + (j) * N * D)
    for (int64_t i = 0; i < nops; i++) {
        const stack_op *op = program + i;
        int failed = 0;
        switch (op->kind) {
        case SOP_KDA: {
            kda_snapshots drafts = {step->draft_rows, op->draft_conv, op->draft_conv_stride, op->draft_rec,
                                    op->draft_rec_stride};
            int with_drafts = step->draft_rows != NULL && op->draft_conv != NULL;
            ds_kda_block(op->descriptor, REG(op->x), REG(op->residual), N, step->nseq, step->cu, step->slots, op->conv,
                         op->conv_stride, op->rec, op->rec_stride, with_drafts ? &drafts : NULL, REG(op->out),
                         nthreads);
            break;
        }
        case SOP_MLA:
            failed = ds_mla_block(op->descriptor, REG(op->x), REG(op->residual), N, step->rows, step->width,
                                  step->write_rows, op->pages, op->ld, op->nrows, (int)op->pages_bf16, REG(op->out),
                                  nthreads);
            break;
        case SOP_DSA:
            failed = ds_dsa_block(op->descriptor, REG(op->x), REG(op->residual), N, step->rows, step->width,
                                  step->write_rows, op->pages, op->ld, op->nrows, (int)op->pages_bf16, op->keys,
                                  op->ldk, (int)op->keys_bf16, step->cos_sin, REG(op->out), nthreads);
            break;
        case SOP_FFN:
            failed = ds_moe_block(op->descriptor, REG(op->x), REG(op->residual), N, REG(op->out), nthreads);
            break;
        case SOP_MIX: {
            int64_t S = op->nsources, src[MAX_MIX_SOURCES];
            if (S < 1 || S > MAX_MIX_SOURCES) return i + 1;
            for (int64_t s = 0; s < S; s++) src[s] = (int64_t)(intptr_t)REG(op->sources[s]);
            ds_attn_res_mix(src, S, N, D, op->norm_w, op->query, op->eps, REG(op->out), nthreads);
            break;
        }
        default:
            return i + 1;
        }
        if (failed) return i + 1;
    }
    return 0;
#undef REG
}
