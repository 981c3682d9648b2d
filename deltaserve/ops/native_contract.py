"""The contract between the Python side and the native kernels (native_src/), defined once, here.

It holds three things:

* the constants both sides read (`CONSTANTS`): the row counts at which products change form, which the fused
  blocks must follow to give their modules' results, and the native program's op codes;
* the records passed by address, as `ctypes.Structure`s with named, typed fields (`STRUCTS`): the few-row linear
  products' tasks (`LinearTask`; ops/native.py, native_src/products.c), one descriptor per fused decode block
  (`KdaBlock`, `MoeBlock`, `MlaBlock`, `DsaBlock`: dimensions, the packed weights' addresses, epsilons and scales;
  built once per layer by backends/native/blocks.py, read by native_src/blocks.c), and
  the program's op record and step inputs (`StackOp`, `StackStep`; backends/native/program.py,
  native_src/stack.c);
* the C prototype of every entry point ctypes calls (`ENTRY_POINTS`), from which `entry_signatures` derives the
  argtypes and restype ops/native.py sets on the loaded library.

`header()` renders all three as C (`#define`s, `typedef struct`s with the same fields in the same order, the
prototypes) and `write_header()` writes it to native_src/contract.h, which is committed and included by
kernels.h, so every kernel source sees the same definitions and the compiler checks each entry point's definition
against its prototype here. tests/test_native_contract.py checks that the committed header is what `header()`
gives now, and compiles a probe with the library's compiler and flags to check that each struct's size and field
offsets, and each constant, are the same on both sides.

C types are named by their spelling (`CType`): an int64 dimension is `int64_t`, an address a `const bf16 *` or
similar (a `c_void_p` to ctypes, so callers pass tensors' `data_ptr()`), a scale a `float`.
"""

from __future__ import annotations

import ctypes
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

HEADER = Path(__file__).with_name("native_src") / "contract.h"

# Plain linears take the row-packed dot tiles up to this many rows and the column-packed product above it
# (backends/native/modules.py says why); the fused blocks switch at the same count to give the linears' results.
LINEAR_MAX_ROWS = 4
# Dense MLPs take the expert kernel on their linears' row packs up to this many rows, their column packs above.
MLP_MAX_ROWS = 8
# Column-packed products of this many rows or more take the AMX tile unit where the CPU and the OS give it
# (native_src/tiles.c), the AVX512-BF16 pair products below: the form follows the row count alone.
TILE_MIN_ROWS = 4
# The most sources one AttnRes mix of a native program takes (the length of `StackOp.sources`).
MAX_MIX_SOURCES = 64
# A native program's op kinds (`StackOp.kind`): the four fused blocks and an AttnRes mix.
SOP_KDA, SOP_MLA, SOP_DSA, SOP_FFN, SOP_MIX = 1, 2, 3, 4, 5
# The vector instruction sets a build of the library was compiled for (`ds_vector_isa`, a bit each): the kernels
# are written for AVX-512 with BF16 pairs (and AMX tiles above a few rows); without them their portable forms
# compile instead. AVX2 and FMA (x86-64-v3) are the floor at which `--backend auto` takes those portable forms
# (ops/native.py `native_choice`).
ISA_AVX512F, ISA_AVX512BF16, ISA_AMX_BF16, ISA_AVX2, ISA_FMA = 1, 2, 4, 8, 16
# How a column-packed matrix (`MxMatrix.format`) stores its weights: bf16 (`pack_columns`), or MX codes in the same
# order with E8M0 scales beside them (`pack_mx_columns`: MXFP8-E4M3, MXFP4-E2M1).
MAT_BF16, MAT_E4M3, MAT_E2M1 = 0, 1, 2
# The MX weight slots of a block's `mx` array (0 for a block over bf16 packs; a slot whose data is 0 keeps the bf16
# pack of that weight): the KDA block's q, k, v, f_a, b and gate input projections, f_b, g_b and o_proj; the MLA
# block's q_proj, kv_a_proj and o_proj; the DSA block's q_a, kv_a and gate projections (together: one pass), q_b and
# o_proj; the FFN block's routed stacks w1, w3, w2, the shared or dense MLP's gate, up and down, and K3's latent down
# and up projections.
KDA_MX_SLOTS, MLA_MX_SLOTS, DSA_MX_SLOTS, MOE_MX_SLOTS = 9, 3, 5, 8
# How a product quantises its input rows (`MxMatrix.act`): not at all, or to MXFP8-E4M3 per 32 with the block
# scale of this rule (ops/mx.py ScaleMode), then back to bf16 (exact: every MXFP8 value is a bf16).
ACT_NONE, ACT_FLOOR, ACT_RCEIL, ACT_CEIL, ACT_EVEN = 0, 1, 2, 3, 4

CONSTANTS = {name: globals()[name] for name in (
    "LINEAR_MAX_ROWS", "MLP_MAX_ROWS", "TILE_MIN_ROWS", "MAX_MIX_SOURCES", "SOP_KDA", "SOP_MLA", "SOP_DSA", "SOP_FFN",
    "SOP_MIX", "ISA_AVX512F", "ISA_AVX512BF16", "ISA_AMX_BF16", "ISA_AVX2", "ISA_FMA", "MAT_BF16", "MAT_E4M3",
    "KDA_MX_SLOTS", "MLA_MX_SLOTS", "DSA_MX_SLOTS", "MOE_MX_SLOTS", "MAT_E2M1", "ACT_NONE", "ACT_FLOOR", "ACT_RCEIL",
    "ACT_CEIL", "ACT_EVEN")}


@dataclass(frozen=True)
class CType:
    """A C type as ctypes passes it and as C spells it (`count`: an array of that many, named by a constant)."""

    ctype: type
    c: str
    count: str | None = None

    def field_type(self) -> type:
        return self.ctype * CONSTANTS[self.count] if self.count else self.ctype


I64, F32 = CType(ctypes.c_int64, "int64_t"), CType(ctypes.c_float, "float")


def pointer(c: str) -> CType:
    """An address, passed as an integer (a tensor's `data_ptr()`; 0 for none)."""
    return CType(ctypes.c_void_p, c)


BF16S, FLOATS, F32_OUT, I64S, ANY, ANY_OUT = map(pointer, ("const bf16 *", "const float *", "float *",
                                                         "const int64_t *", "const void *", "void *"))
MX_SLOTS = pointer("const mx_matrix *")  # a block's MX weights: an array of MxMatrix (its address)


def _layout(cls):
    """Sets a contract struct's ctypes `_fields_` from its `fields`: (name, CType, note) in C order."""
    cls._fields_ = [(name, kind.field_type()) for name, kind, _ in cls.fields]
    return cls


@_layout
class LinearTask(ctypes.Structure):
    """One product of ds_linear_bf16: y [M, n] (row stride ldy) = x [M, K] (row stride ldx) @ W^T for W [n, K]
    row-major (row stride ldw) or packed by pack_rows (ldw -1); the tasks of a call may share x (several weights
    over one input) or not (one weight per attention head)."""

    c_name = "linear_task"
    fields = [
        ("w", BF16S, ""), ("ldw", I64, "-1: packed"), ("n", I64, ""), ("y", CType(ctypes.c_void_p, "bf16 *"), ""),
        ("ldy", I64, ""), ("x", BF16S, ""), ("ldx", I64, ""),
    ]


@_layout
class MxMatrix(ctypes.Structure):
    """A column-packed weight matrix [N, K] (or a stack of them, one per expert, one after another) as the column
    products read it: bf16 (MAT_BF16, `pack_columns`; scales 0) or MX codes in that order (MAT_E4M3: two bytes a
    pair of k, MAT_E2M1: one byte a pair, element 2p in the low nibble) with one E8M0 scale byte a column per 32 of
    K (`pack_mx_columns`), and how the product quantises its input rows (ACT_*)."""

    c_name = "mx_matrix"
    fields = [
        ("data", ANY, ""), ("scales", pointer("const uint8_t *"), "[blocks][K / 32][64]; 0 for bf16"),
        ("format", I64, "MAT_*"), ("act", I64, "ACT_*"),
    ]


@_layout
class KdaBlock(ctypes.Structure):
    """ds_kda_block: a KDA layer's attention block. The input projections are stacked q | k | v | f_a | b | g (g:
    g_a of width head_dim, or the full-rank gate of width heads * head_dim when w_gb is 0); each weight row-packed
    (w_*) and column-packed (c_*, read above LINEAR_MAX_ROWS rows)."""

    c_name = "kda_block"
    fields = [
        ("hidden", I64, "D"), ("heads", I64, "H"), ("head_dim", I64, "K"), ("conv_width", I64, "W"),
        ("in_width", I64, "the stacked input projections' outputs"),
        ("norm_w", BF16S, "the block's RMSNorm weight"), ("w_in", BF16S, ""), ("w_fb", BF16S, ""),
        ("w_gb", BF16S, "0: the full-rank gate"), ("dt_bias", FLOATS, ""), ("a_log", FLOATS, ""),
        ("conv_w", FLOATS, "[3 H K, W]"), ("onorm_w", FLOATS, ""), ("w_o", BF16S, ""),
        ("c_in", BF16S, ""), ("c_fb", BF16S, ""), ("c_gb", BF16S, ""), ("c_o", BF16S, ""),
        ("eps", F32, ""), ("onorm_eps", F32, ""), ("lower_bound", F32, "NaN: none"), ("scale", F32, ""),
        ("mx", MX_SLOTS, "[KDA_MX_SLOTS]; 0: bf16 packs"),
    ]


@_layout
class KdaSnapshots(ctypes.Structure):
    """Where ds_kda_step also keeps the state after single rows (a verify step's drafts, docs/serving.md §9.3): per
    row of the step, the index of a state slot of these pools (conv [slots, 3 H K, W-1], rec [slots, H, K, K] at
    the given slot strides) that receives the sequence's state after that row, or -1."""

    c_name = "kda_snapshots"
    fields = [
        ("rows", I64S, "[N]"), ("conv", F32_OUT, ""), ("conv_stride", I64, ""), ("rec", F32_OUT, ""),
        ("rec_stride", I64, ""),
    ]


@_layout
class MoeBlock(ctypes.Structure):
    """ds_moe_block: a layer's FFN block, routed experts (experts > 0, column-packed stacks; latent > 0: K3's
    latent form around them) and/or a shared or dense gated MLP (shared_width > 0: row packs s*, column packs
    c_s*)."""

    c_name = "moe_block"
    fields = [
        ("hidden", I64, "D"), ("norm_w", BF16S, ""),
        ("experts", I64, "E (0: no routed experts)"), ("expert_width", I64, "I"), ("topk", I64, "k"),
        ("router_w", FLOATS, "[E, D]"), ("router_bias", FLOATS, "[E]"), ("softmax", I64, "0: sigmoid scores"),
        ("groups", I64, ""), ("topk_group", I64, ""), ("renorm", I64, ""),
        ("w1", BF16S, ""), ("w3", BF16S, ""), ("w2", BF16S, ""),
        ("shared_width", I64, "IS (0: no shared or dense MLP)"), ("s1", BF16S, ""), ("s3", BF16S, ""),
        ("s2", BF16S, ""), ("situ", I64, "0: SiLU-GLU, 1: SiTU"),
        ("latent", I64, "L (0: plain MoE)"), ("w_down", BF16S, ""), ("latent_norm_w", BF16S, "0: none"),
        ("w_up", BF16S, ""), ("c_s1", BF16S, ""), ("c_s3", BF16S, ""), ("c_s2", BF16S, ""),
        ("eps", F32, ""), ("routed_scale", F32, ""), ("situ_beta", F32, ""),
        ("situ_linear_beta", F32, "NaN: none"), ("latent_eps", F32, ""),
        ("mx", MX_SLOTS, "[MOE_MX_SLOTS]; 0: bf16 packs"),
    ]


@_layout
class MlaBlock(ctypes.Structure):
    """ds_mla_block: Kimi's dense NoPE MLA block. W_UK^T and W_UV packed per head; each weight row-packed (w_*) and
    column-packed (c_*, read above LINEAR_MAX_ROWS rows)."""

    c_name = "mla_block"
    fields = [
        ("hidden", I64, "D"), ("heads", I64, "H"), ("nope", I64, ""), ("rope", I64, ""), ("v_dim", I64, ""),
        ("rank", I64, "R, the latent width"),
        ("norm_w", BF16S, ""), ("w_q", BF16S, ""), ("w_kva", BF16S, ""), ("kva_norm_w", BF16S, ""),
        ("w_uk", BF16S, ""), ("w_uv", BF16S, ""), ("w_o", BF16S, ""),
        ("c_q", BF16S, ""), ("c_kva", BF16S, ""), ("c_uk", BF16S, ""), ("c_uv", BF16S, ""), ("c_o", BF16S, ""),
        ("eps", F32, ""), ("kva_eps", F32, ""), ("scale", F32, ""),
        ("mx", MX_SLOTS, "[MLA_MX_SLOTS]; 0: bf16 packs"),
    ]


@_layout
class DsaBlock(ctypes.Structure):
    """ds_dsa_block: a DSA layer's block (query LoRA), its weights row-packed only. w_a stacks q_a (q_rank) | kv_a
    (rank + rope) | gate (gate_width, or none) | index wk (index_dim) | index weights (index_heads); when q_a, kv_a and
    the gate are stored MX (slots 0-2), w_a holds only the index wk | weights rows."""

    c_name = "dsa_block"
    fields = [
        ("hidden", I64, "D"), ("heads", I64, "H"), ("nope", I64, ""), ("rope", I64, ""), ("v_dim", I64, ""),
        ("rank", I64, "R, the latent width"), ("q_rank", I64, ""), ("a_width", I64, "w_a's outputs"),
        ("gate_width", I64, "0: no output gate"), ("index_dim", I64, ""), ("index_rope", I64, ""),
        ("index_heads", I64, ""), ("index_topk", I64, ""),
        ("norm_w", BF16S, ""), ("w_a", BF16S, ""), ("qa_norm_w", BF16S, ""), ("w_qb", BF16S, ""),
        ("kva_norm_w", BF16S, ""), ("ik_norm_w", BF16S, ""), ("ik_norm_b", BF16S, ""), ("w_uk", BF16S, ""),
        ("w_uv", BF16S, ""), ("w_o", BF16S, ""), ("w_iq", BF16S, "the index queries' wq_b"),
        ("eps", F32, ""), ("q_eps", F32, ""), ("kv_eps", F32, ""), ("index_eps", F32, ""), ("scale", F32, ""),
        ("index_weight_scale", F32, "index_heads^-1/2"), ("index_dim_scale", F32, "index_dim^-1/2"),
        ("mx", MX_SLOTS, "[DSA_MX_SLOTS]; 0: bf16 packs"),
    ]


@_layout
class StackOp(ctypes.Structure):
    """One op of a native program: a fused block (its descriptor and its layer's cache) or an AttnRes mix,
    over registers (indices into the register file; -1: none). Each kind reads its own fields only."""

    c_name = "stack_op"
    fields = [
        ("kind", I64, "SOP_*"), ("x", I64, ""), ("residual", I64, ""), ("out", I64, ""),
        ("descriptor", ANY, "the block's *_block"),
        ("conv", F32_OUT, "KDA: the conv state pool"), ("conv_stride", I64, ""),
        ("rec", F32_OUT, "KDA: the recurrent state pool"), ("rec_stride", I64, ""),
        ("draft_conv", F32_OUT, "KDA: the draft states' conv pool (0: none)"), ("draft_conv_stride", I64, ""),
        ("draft_rec", F32_OUT, "KDA: the draft states' recurrent pool"), ("draft_rec_stride", I64, ""),
        ("pages", ANY_OUT, "MLA, DSA: the latent rows"), ("ld", I64, ""), ("nrows", I64, ""),
        ("pages_bf16", I64, ""), ("keys", ANY_OUT, "DSA: the index-key rows"), ("ldk", I64, ""),
        ("keys_bf16", I64, ""),
        ("query", BF16S, "mix: the query weight"), ("norm_w", BF16S, ""), ("eps", F32, ""),
        ("nsources", I64, ""), ("sources", CType(ctypes.c_int64, "int64_t", "MAX_MIX_SOURCES"), "registers"),
    ]


@_layout
class StackStep(ctypes.Structure):
    """A step's own inputs, shared by every op of the program (0: not used by its blocks)."""

    c_name = "stack_step"
    fields = [
        ("nseq", I64, "the step's sequences"), ("cu", I64S, "KDA: the sequences' row offsets [nseq + 1], 0: one row each"),
        ("slots", I64S, "the KDA state slots [nseq]"), ("rows", I64S, "the sequences' cache rows [N, width]"),
        ("width", I64, ""), ("write_rows", I64S, "the new tokens' cache rows [N]"),
        ("cos_sin", FLOATS, "DeepSeek-V3.2's rotation at the tokens' positions [2, N, rope / 2]"),
        ("draft_rows", I64S, "KDA: the draft state taking the state after each row [N], -1: none (0: no drafts)"),
    ]


STRUCTS = (LinearTask, MxMatrix, KdaBlock, KdaSnapshots, MoeBlock, MlaBlock, DsaBlock, StackOp, StackStep)

# Every entry point ctypes calls, as C declares it; each is documented where it is defined (native_src/*.c).
ENTRY_POINTS = """
void ds_linear_bf16(int64_t M, int64_t K, int64_t ntasks, const linear_task *tasks, int nthreads);
int ds_moe_bf16(const bf16 *x, int64_t T, int64_t D, const int64_t *experts, const float *weights, int64_t k,
    const bf16 *w1, const bf16 *w3, const bf16 *w2, int64_t E, int64_t I, int packed, int act_kind, float beta,
    float lin_beta, const bf16 *s1, const bf16 *s3, const bf16 *s2, int64_t IS, int tiles, bf16 *h, bf16 *out,
    int nthreads);
void ds_linear_columns(const bf16 *x, int64_t M, int64_t ldx, int64_t K, const bf16 *w, int64_t N, bf16 *out,
    int tiles, int nthreads);
void ds_heads_columns(const bf16 *x, int64_t M, int64_t ldx, int64_t hx, int64_t H, int64_t K, const bf16 *w,
    int64_t N, bf16 *out, int tiles, int nthreads);
int ds_mx_linear(const bf16 *x, int64_t M, int64_t ldx, int64_t K, const mx_matrix *w, int64_t N, bf16 *out,
    int tiles, int nthreads);
int ds_mx_moe(const bf16 *x, int64_t T, int64_t D, const int64_t *experts, const float *weights, int64_t k,
    const mx_matrix *w1, const mx_matrix *w3, const mx_matrix *w2, int64_t E, int64_t I, int act_kind, float beta,
    float lin_beta, const mx_matrix *s1, const mx_matrix *s3, const mx_matrix *s2, int64_t IS, int tiles,
    bf16 *out, int nthreads);
void ds_mx_quantize_rows(const bf16 *x, int64_t M, int64_t K, int64_t ldx, int act, bf16 *out, int nthreads);
void ds_mx_unpack_block(const mx_matrix *w, int64_t K, int64_t b, bf16 *out);
int ds_tiles_usable(void);
int ds_vector_isa(void);
void ds_rmsnorm_bf16(const bf16 *x, int64_t M, int64_t D, int64_t ldx, const bf16 *w, float eps, bf16 *out,
    int nthreads);
void ds_kda_step(int64_t nseq, const int64_t *cu, int64_t H, int64_t K, const void *x, int64_t ldx, int x_bf16,
    const float *conv_w, int64_t W, float *conv, int64_t conv_slot_stride, const float *g, const float *beta,
    float scale, float *rec, int64_t rec_slot_stride, const int64_t *slots, const kda_snapshots *snaps, float *out,
    int nthreads);
int ds_qsfa(int64_t T, int64_t H, int64_t r, int64_t rho, const float *q_lat, const float *q_pe, const void *lat,
    int64_t ld, int64_t nrows, int lat_bf16, const int64_t *selected, int64_t nsel, float scale, float *out,
    float *lse, int nthreads);
void ds_gated_rmsnorm_bf16(const float *core, int64_t R, int64_t K, const bf16 *gate, int64_t ldg, const float *w,
    float eps, bf16 *out, int nthreads);
void ds_kda_gate(const bf16 *u, int64_t ldu, const bf16 *b, int64_t ldb, int64_t T, int64_t H, int64_t K,
    const float *dt_bias, const float *A_log, float lower_bound, float *g, float *beta, int nthreads);
int ds_router(const bf16 *x, int64_t T, int64_t D, int64_t ldx, const float *w, const float *bias, int64_t E,
    int softmax, int64_t ngroups, int64_t topk_group, int64_t k, int renorm, float scale, int64_t *experts,
    float *weights, int nthreads);
void ds_attn_res_mix(const int64_t *src, int64_t S, int64_t N, int64_t D, const bf16 *norm_w, const bf16 *query,
    float eps, bf16 *out, int nthreads);
void ds_kda_block(const kda_block *d, const bf16 *xin, const bf16 *r, int64_t N, int64_t nseq,
    const int64_t *cu_rows, const int64_t *slots, float *conv, int64_t conv_stride, float *rec, int64_t rec_stride,
    const kda_snapshots *snaps, bf16 *out, int nthreads);
int ds_moe_block(const moe_block *d, const bf16 *xin, const bf16 *r, int64_t T, bf16 *out, int nthreads);
int ds_mla_block(const mla_block *d, const bf16 *xin, const bf16 *r, int64_t N, const int64_t *selected,
    int64_t nsel, const int64_t *write_rows, void *pages, int64_t ld, int64_t nrows, int pages_bf16, bf16 *out,
    int nthreads);
int ds_dsa_block(const dsa_block *d, const bf16 *xin, const bf16 *r, int64_t N, const int64_t *selected,
    int64_t nsel, const int64_t *write_rows, void *pages, int64_t ld, int64_t nrows, int pages_bf16, void *keys,
    int64_t ldk, int keys_bf16, const float *cos_sin, bf16 *out, int nthreads);
void ds_index_select(const bf16 *q, const float *w, int64_t HI, int64_t DI, const int64_t *rows, int64_t n,
    const void *keys, int64_t ldk, int keys_bf16, int64_t topk, int64_t *selected, int nthreads);
void ds_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *out, int nthreads);
int64_t ds_run_program(const stack_op *program, int64_t nops, int64_t N, int64_t D, bf16 *regs,
    const stack_step *step, int nthreads);
"""

_SCALARS = {"void": None, "int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}


def _ctype(spelling: str):
    """The ctypes type of a C parameter or return type: scalars as themselves, a contract struct's address as a
    pointer to it (ctypes then takes the struct itself), any other address as `c_void_p`."""
    spelling = spelling.replace("const ", "").strip()
    if not spelling.endswith("*"):
        return _SCALARS[spelling]
    target = spelling[:-1].strip()
    struct = next((s for s in STRUCTS if s.c_name == target), None)
    return ctypes.POINTER(struct) if struct is not None else ctypes.c_void_p


def prototypes() -> list[str]:
    """ENTRY_POINTS, one declaration a string, whitespace collapsed."""
    return [" ".join(p.split()) + ";" for p in ENTRY_POINTS.split(";") if p.strip()]


def entry_signatures() -> dict[str, tuple[list, type | None]]:
    """Each entry point's (argtypes, restype), derived from its prototype."""
    signatures = {}
    for proto in prototypes():
        restype, name, params = re.fullmatch(r"(.+?)\s*\b(\w+)\((.*)\);", proto).groups()
        params = [] if params == "void" else [re.fullmatch(r"(.+?)\s*\w+", p.strip()).group(1)
                                              for p in params.split(",")]
        signatures[name] = ([_ctype(p) for p in params], _ctype(restype))
    return signatures


def set_signatures(lib: ctypes.CDLL) -> None:
    """Set every entry point's argtypes and restype on the loaded library."""
    for name, (argtypes, restype) in entry_signatures().items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype


def _comment(text: str) -> list[str]:
    """`text` as a C block comment of lines of at most 119 characters."""
    lines = textwrap.wrap(" ".join(text.split()), 116)
    if len(lines) == 1:
        return [f"/* {lines[0]} */"]
    return [f"/* {lines[0]}", *(f" * {line}" for line in lines[1:-1]), f" * {lines[-1]} */"]


def header() -> str:
    """The C side of the contract: native_src/contract.h as this module defines it now."""
    out = [*_comment("Generated from deltaserve/ops/native_contract.py by its write_header(); edit that module and "
                     "run it again, not this file. The constants, the records passed by address and the entry "
                     "points' prototypes shared by the kernels and the Python side (see that module's docstring)."),
           "#ifndef DELTASERVE_NATIVE_CONTRACT_H", "#define DELTASERVE_NATIVE_CONTRACT_H", '#include "common.h"', ""]
    out += ["/* Why each constant has its value: ops/native_contract.py. */"]
    out += [f"#define {name} {value}" for name, value in CONSTANTS.items()]
    for struct in STRUCTS:
        out += ["", *_comment(struct.__doc__), "typedef struct {"]
        for name, kind, note in struct.fields:
            declaration = f"    {kind.c}{'' if kind.c.endswith('*') else ' '}{name}"
            declaration += f"[{kind.count}];" if kind.count else ";"
            out.append(f"{declaration} /* {note} */" if note else declaration)
        out.append(f"}} {struct.c_name};")
    out += ["", *map(_wrapped, prototypes()), "", "#endif", ""]
    return "\n".join(out)


def _wrapped(prototype: str, width: int = 118) -> str:
    """A prototype over lines of at most `width`, broken between parameters."""
    head, params = prototype.split("(", 1)
    lines, line = [], head + "("
    for param in params.split(", "):
        if len(line) + len(param) + 2 > width:
            lines.append(line.rstrip())
            line = "    "
        line += param + ", "
    return "\n".join([*lines, line[:-2]])


def write_header(path: Path = HEADER) -> None:
    """Write `header()` to native_src/contract.h; run after changing this module (`python -c "from
    deltaserve.ops.native_contract import write_header; write_header()"`) and commit the header with it."""
    path.write_text(header())
