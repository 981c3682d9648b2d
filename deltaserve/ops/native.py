"""The native CPU kernels (`native_src/`: products.c, experts.c, tiles.c, attention.c, blocks.c, indexer.c, stack.c,
sampling.c, isa.c, common.h, kernels.h, contract.h): built once per machine, loaded through ctypes with the entry
points' signatures of ops/native_contract.py. On CPUs with AMX-BF16 the column-packed products (linears above 4 rows, the
routed and shared experts) run on the tile unit from 4 rows up (`tiles_usable`).

The sources are compiled at first use with the system C compiler (`cc`, else `gcc`) for the CPU
`envs.native_march()` names (DELTASERVE_NATIVE_MARCH, default this one: -march=native, on ARM -mcpu=native; CI
also builds for x86-64-v3) into the cache folder (`envs.cache_dir()`), under a name that hashes the sources, the
flags and the compiler, so an edit, another target or a different machine builds anew; a concurrent build by
another process is harmless (atomic rename). Without a compiler `native_library()` returns None and every caller
keeps its torch path. On a CPU without AVX-512 BF16 (AVX2-only x86, ARM) the kernels' portable forms compile; the
log says which forms were built, and `native_choice` says whether `--backend auto` takes them.

The wrappers take torch tensors and check what the C side assumes (bf16, CPU, contiguous rows); the reference
twins are `F.linear`, the torch MoE dispatch and router in `layers/moe.py` and the torch norms (tests/test_native.py
and tests/test_native_ops.py hold them together). The KDA kernels are wrapped by `ops/kda_native.py` (the `_native`
ops of the native op set, each beside its torch twin and reference), AttnRes mixing by `ops/attn_res.py`, the
fused blocks (blocks.c) by `backends/native/blocks.py` and the programs that run them (stack.c) by
`backends/native/program.py`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import mmap
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from .. import envs
from .mx import BLOCK, E2M1, E4M3, ElementFormat, ScaleMode, element_format
from .native_contract import (ACT_CEIL, ACT_EVEN, ACT_FLOOR, ACT_NONE, ACT_RCEIL, ISA_AMX_BF16, ISA_AVX2,
                              ISA_AVX512BF16, ISA_AVX512F, ISA_FMA, MAT_BF16, MAT_E2M1, MAT_E4M3, LinearTask, MxMatrix,
                              set_signatures)

log = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("native_src")


def _arm(machine: str) -> bool:
    return machine.lower().startswith(("arm", "aarch64"))


def build_flags(march: str | None = None) -> list[str]:
    """The compiler flags of the library, for the CPU `march` (default `envs.native_march()`) as gcc's -march takes
    it; `native` on ARM is spelled -mcpu=native there."""
    march = envs.native_march() if march is None else march
    target = "-mcpu=native" if march == "native" and _arm(platform.machine()) else f"-march={march}"
    return ["-O3", target, "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]


# The flags `native_library` builds with, DELTASERVE_NATIVE_MARCH read once, when this module is imported.
FLAGS = build_flags()
# The ISA_* bits by name, in the order `isa_names` lists them.
_ISA_NAMES = ((ISA_AVX2, "AVX2"), (ISA_FMA, "FMA"), (ISA_AVX512F, "AVX-512F"), (ISA_AVX512BF16, "AVX-512 BF16"),
              (ISA_AMX_BF16, "AMX-BF16"))


def isa_names(isa: int) -> str:
    """The instruction sets of `ds_vector_isa()` bits, as "AVX2+FMA+AVX-512F"; "" for none of them."""
    return "+".join(name for bit, name in _ISA_NAMES if isa & bit)


def compiler() -> str | None:
    """The system C compiler the library is built with (`cc`, else `gcc`), or None."""
    return shutil.which("cc") or shutil.which("gcc")


@functools.lru_cache(maxsize=1)
def native_library() -> ctypes.CDLL | None:
    """The loaded kernels, or None when there is no compiler or the build fails (logged once). The log also says
    what the build is vectorised for: the kernels are written for AVX-512 with BF16 pairs (and AMX tiles); the
    products that read weights (dot tiles, column tiles, MX decoding) also have AVX2 + FMA (+ F16C for MX) forms; the
    rest, and everything on other CPUs (ARM), compiles from portable C, vectorised as far as the compiler manages."""
    lib = build_library(FLAGS)
    if lib is None:
        return None
    isa, target = lib.ds_vector_isa(), FLAGS[1]
    if isa & ISA_AVX512BF16:
        log.debug("native kernels (%s): AVX-512 BF16%s", target, " and AMX-BF16 tiles" if isa & ISA_AMX_BF16 else "")
    else:
        log.debug("native kernels (%s): built without AVX-512 BF16, so their AVX2 products (where the build has "
                  "AVX2 and FMA) and portable forms run, vectorised by the compiler for %s", target,
                  isa_names(isa) or platform.machine() or "this CPU")
    return lib


def native_choice() -> tuple[bool, str]:
    """Whether `--backend auto` takes the native kernels, and why, in one sentence (for the log and /version).
    They are written for AVX-512 BF16 (and AMX); their portable forms built for AVX2+FMA were measured faster than
    torch on an AVX2 EPYC (BENCHMARKS.md, "The native kernels without AVX-512"). So: yes on x86-64 when the library
    builds and was compiled for at least AVX2+FMA (x86-64-v3, read from its `ds_vector_isa()`); torch on other CPU
    kinds (ARM: not measured), when the build fails, and below x86-64-v3 (not measured)."""
    machine = platform.machine() or "unknown"
    if machine.lower() not in ("x86_64", "amd64", "x64"):
        return False, f"{machine}: the native kernels are not measured against torch on this CPU kind, so torch runs"
    lib = native_library()
    if lib is None:
        why = "there is no C compiler" if compiler() is None else "their build failed, see the log"
        return False, f"the native kernels did not build ({why}), so torch runs"
    isa, target = lib.ds_vector_isa(), FLAGS[1]
    names = isa_names(isa)
    if isa & (ISA_AVX2 | ISA_FMA) != ISA_AVX2 | ISA_FMA:
        return False, (f"{machine} built for {names or 'no AVX2'} ({target}): below x86-64-v3 the native kernels "
                       "are not measured against torch, so torch runs")
    if isa & ISA_AVX512BF16:
        return True, (f"{machine} built for {names} ({target}): the native kernels run the AVX-512 BF16 forms they "
                      "are written for")
    return True, (f"{machine} built for {names} ({target}): the native kernels' AVX2 products and portable forms, "
                  "measured faster than torch on an AVX2 EPYC (BENCHMARKS.md)")


def build_library(flags: list[str]) -> ctypes.CDLL | None:
    """The kernels compiled with `flags` and loaded, or None when there is no compiler or the build fails (logged).
    Built once into the cache folder, under a name that hashes the sources, the flags and the compiler."""
    cc = compiler()
    if cc is None:
        log.warning("no C compiler: native decode kernels off, torch paths used")
        return None
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    files = sorted(SOURCES.glob("*.[ch]"))
    digest = hashlib.sha256(" ".join(flags).encode() + version.encode())
    for f in files:
        digest.update(f.name.encode() + f.read_bytes())
    key = digest.hexdigest()[:16]
    target = envs.cache_dir() / "native" / f"kernels-{key}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        except OSError as e:
            log.warning("cannot write the native kernels to %s (%s): torch paths used", target.parent, e)
            return None
        os.close(fd)
        sources = [str(f) for f in files if f.suffix == ".c"]
        log.info("building the native kernels with %s (%s): once per source or compiler change, it can take a "
                 "minute", cc, " ".join(flags))
        build = subprocess.run([cc, *flags, *sources, "-o", tmp, "-lm"], capture_output=True, text=True)
        if build.returncode != 0:
            os.unlink(tmp)
            log.warning("building the native kernels failed, torch paths used:\n%s", build.stderr[-2000:])
            return None
        os.replace(tmp, target)
    lib = ctypes.CDLL(str(target))
    set_signatures(lib)
    return lib


def tiles_usable() -> bool:
    """The column-packed products can take the AMX tile unit: the CPU has AMX-BF16, the library was built for it
    and the OS granted this process the tile state (native_src/tiles.c)."""
    lib = native_library()
    return lib is not None and bool(lib.ds_tiles_usable())


def native_usable(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """The kernels apply: bf16 weights on the CPU and a library that built."""
    return dtype == torch.bfloat16 and torch.device(device).type == "cpu" and native_library() is not None


def _rows(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.dim() == 2 and t.stride(1) == 1


# The kernels' two weight layouts, both [..., N, K] cut into blocks of R rows and each block stored as
# [ceil(K/G), R, G] (rows and K zero-padded), so a block is one sequential stream: (R, G) = (4, 32) for the
# dot-product tiles (`pack_rows`), (64, 2) for the experts' outer-product kernel (`pack_columns`).
ROW_TILES, COLUMN_BLOCKS = (4, 32), (64, 2)


def _blocked_shape(shape: tuple[int, ...], layout: tuple[int, int]) -> tuple[int, ...]:
    (*lead, N, K), (R, G) = shape, layout
    return (*lead, -(-N // R), -(-K // G), R, G)


def _pack_blocks(w: torch.Tensor, layout: tuple[int, int]) -> torch.Tensor:
    *lead, nb, kb, R, G = _blocked_shape(tuple(w.shape), layout)
    N, K = w.shape[-2:]
    padded = torch.nn.functional.pad(w.detach().to(torch.bfloat16), (0, kb * G - K, 0, nb * R - N))
    blocks = padded.reshape(*lead, nb, R, kb, G).transpose(-3, -2)
    return huge_page_empty(blocks.shape, torch.bfloat16).copy_(blocks)


def packed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape `pack_rows` gives weights of this shape."""
    return _blocked_shape(shape, ROW_TILES)


def pack_rows(w: torch.Tensor) -> torch.Tensor:
    """The kernels' packed layout of bf16 weights [..., N, K] (one matrix, or a stack: experts): per matrix, tiles
    of 4 rows, each [ceil(K/32), 4, 32] with rows and K zero-padded, so a tile is one sequential stream (row-major
    rows are 4 short streams; the hardware prefetchers stream one long run from DRAM faster than four short ones,
    and decode waits on DRAM). Held in huge pages where
    the system gives them (`huge_page_empty`)."""
    return _pack_blocks(w, ROW_TILES)


def column_packed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape `pack_columns` gives weights of this shape."""
    return _blocked_shape(shape, COLUMN_BLOCKS)


def pack_columns(w: torch.Tensor) -> torch.Tensor:
    """The expert kernel's column-packed layout of bf16 weights [..., N, K] (native_src/experts.c): per matrix,
    blocks of 64 output rows, each [ceil(K/2), 64, 2] (pairs of k inner, the order AVX512-BF16's pair products
    take), rows and K zero-padded, so a block is one sequential stream. Huge pages as `pack_rows`."""
    return _pack_blocks(w, COLUMN_BLOCKS)


HUGE_PAGE = 2 << 20


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor that starts on a 2 MiB boundary of private anonymous memory advised
    for transparent huge pages (Linux; elsewhere, or under 2 MiB, a plain `torch.empty`). The decode kernels
    stream every weight once a step: with 4 KiB pages the hardware prefetchers stop at each page boundary and
    every page costs a TLB miss, so huge pages raise the bandwidth the single-row products reach. The tensor keeps
    its mapping alive; the memory past the tensor's end is never touched, so it costs no RAM."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        area.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without transparent huge pages: ordinary pages, same layout
        pass
    raw = torch.frombuffer(area, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes].view(dtype).view(shape)


def linear_packed(x: torch.Tensor, packed: torch.Tensor, n_out: int) -> torch.Tensor:
    """x [M, K] (bf16, contiguous rows) @ W^T for W [n_out, K] packed by `pack_rows`; returns [M, n_out] bf16."""
    M, K = x.shape
    if not (_rows(x) and packed.dtype == torch.bfloat16 and packed.is_contiguous()
            and tuple(packed.shape) == packed_shape((n_out, K))):
        raise ValueError("linear_packed takes bf16 x [M, K] with contiguous rows and a pack_rows weight of that K")
    y = torch.empty(M, n_out, dtype=torch.bfloat16)
    task = LinearTask(w=packed.data_ptr(), ldw=-1, n=n_out, y=y.data_ptr(), ldy=n_out, x=x.data_ptr(), ldx=x.stride(0))
    native_library().ds_linear_bf16(M, K, 1, task, torch.get_num_threads())
    return y


def linear_columns(x: torch.Tensor, packed: torch.Tensor, n_out: int, tiles: bool = True) -> torch.Tensor:
    """x [M, K] (bf16, contiguous rows) @ W^T for W [n_out, K] packed by `pack_columns`, any M; returns [M, n_out]
    bf16, each output rounded once from its fp32 sum (native_src/experts.c ds_linear_columns). With `tiles`, from
    TILE_MIN_ROWS (ops/native_contract.py) rows on the AMX tile unit where the CPU has one (`tiles_usable`), the
    AVX512 pair products otherwise: the same contract, another fp32 summation order (native_src/tiles.c)."""
    M, K = x.shape
    if not (_rows(x) and packed.dtype == torch.bfloat16 and packed.is_contiguous()
            and tuple(packed.shape) == column_packed_shape((n_out, K))):
        raise ValueError("linear_columns takes bf16 x [M, K] with contiguous rows and a pack_columns weight of that K")
    y = torch.empty(M, n_out, dtype=torch.bfloat16)
    if M:
        native_library().ds_linear_columns(x.data_ptr(), M, x.stride(0), K, packed.data_ptr(), n_out, y.data_ptr(),
                                           tiles, torch.get_num_threads())
    return y


def linear_heads(x: torch.Tensor, packed: torch.Tensor, n_out: int) -> torch.Tensor:
    """Per head h: y[:, h] = x[:, h] @ W_h^T, for bf16 x [T, H, K] (last dim contiguous) and W [H, n_out, K]
    packed by `pack_rows`, in one parallel call; returns [T, H, n_out] bf16."""
    T, H, K = x.shape
    if not (x.dtype == torch.bfloat16 and x.stride(-1) == 1 and packed.dtype == torch.bfloat16
            and packed.is_contiguous() and tuple(packed.shape) == packed_shape((H, n_out, K))):
        raise ValueError("linear_heads takes bf16 x [T, H, K] and pack_rows of weights [H, n_out, K]")
    y = torch.empty(T, H, n_out, dtype=torch.bfloat16)
    w0, y0, x0 = packed.data_ptr(), y.data_ptr(), x.data_ptr()
    # byte addresses of head h's weight, output and input (2 bytes an element)
    tasks = (LinearTask * H)(*(LinearTask(w=w0 + 2 * h * packed.stride(0), ldw=-1, n=n_out, y=y0 + 2 * h * n_out,
                                          ldy=H * n_out, x=x0 + 2 * h * x.stride(1), ldx=x.stride(0))
                               for h in range(H)))
    native_library().ds_linear_bf16(T, K, H, tasks, torch.get_num_threads())
    return y


def linear_heads_columns(x: torch.Tensor, packed: torch.Tensor, n_out: int, tiles: bool = True) -> torch.Tensor:
    """`linear_heads` over `pack_columns` of the heads' weights [H, n_out, K], any T: each head's product as
    `linear_columns` (the same sums), all heads' column blocks in one parallel call (native_src/experts.c
    ds_heads_columns); returns [T, H, n_out] bf16."""
    T, H, K = x.shape
    if not (x.dtype == torch.bfloat16 and x.stride(-1) == 1 and packed.dtype == torch.bfloat16
            and packed.is_contiguous() and tuple(packed.shape) == column_packed_shape((H, n_out, K))):
        raise ValueError("linear_heads_columns takes bf16 x [T, H, K] and pack_columns of weights [H, n_out, K]")
    y = torch.empty(T, H, n_out, dtype=torch.bfloat16)
    if T:
        native_library().ds_heads_columns(x.data_ptr(), T, x.stride(0), x.stride(1), H, K, packed.data_ptr(), n_out,
                                          y.data_ptr(), tiles, torch.get_num_threads())
    return y


# ---- MX weights in the column-packed order (native_src/mx.c) ----

_MAT_OF = {"e4m3": MAT_E4M3, "e2m1": MAT_E2M1}
ACT_OF = {None: ACT_NONE, ScaleMode.FLOOR: ACT_FLOOR, ScaleMode.RCEIL: ACT_RCEIL, ScaleMode.CEIL: ACT_CEIL,
          ScaleMode.EVEN: ACT_EVEN}
# The E8M0 scale bytes at which every non-zero element's product with its scale is a normal bf16, so the kernels'
# decoder (which builds the bf16 exponent directly) is exact: native_src/mx.c says why.
_EXACT_SCALES = {"e4m3": (10, 246), "e2m1": (2, 252)}


class ColumnMatrix(NamedTuple):
    """A matrix [N, K], or a stack [..., N, K] of them, as the column products read it (native_src/experts.c, mx.c):
    bf16 in `pack_columns`' layout (scales None) or MX codes in that order with their E8M0 scales
    (`mx_columns`); `act` (ACT_*): how a product quantises its input rows to MXFP8 first."""

    data: torch.Tensor
    scales: torch.Tensor | None
    format: int
    shape: tuple[int, ...]
    act: int = ACT_NONE

    def struct(self) -> MxMatrix:
        return MxMatrix(data=self.data.data_ptr(), scales=0 if self.scales is None else self.scales.data_ptr(),
                        format=self.format, act=self.act)

    def quantising(self, mode: ScaleMode | None) -> "ColumnMatrix":
        """The same weights, their products quantising inputs by scale rule `mode` (None: not at all)."""
        return self._replace(act=ACT_OF[mode])

    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)


def _codes(data: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """The element codes as uint8 [..., K] (FP4: one code a byte, unpacked)."""
    if fmt is E2M1:
        return torch.stack([data & 15, data >> 4], dim=-1).flatten(-2)
    return data.view(torch.uint8)


def mx_exact(data: torch.Tensor, scale: torch.Tensor, fmt: str | ElementFormat) -> bool:
    """Whether the kernels decode these MX weights exactly (ops/mx.py storage: float8 [..., N, K] or packed FP4
    uint8 [..., N, K/2], scales uint8 [..., N, K/32]): E4M3 or E2M1 elements, no NaN code, and every block with a
    non-zero element scaled within the range where its products are normal bf16s."""
    fmt = element_format(fmt)
    if fmt.name not in _MAT_OF:
        return False
    magnitude = _codes(data, fmt) & (0x7F if fmt is E4M3 else 0x7)
    if fmt is E4M3 and bool((magnitude == 0x7F).any()):
        return False
    lo, hi = _EXACT_SCALES[fmt.name]
    live = magnitude.reshape(*scale.shape, BLOCK).ne(0).any(-1)
    return not bool((live & ((scale < lo) | (scale > hi))).any())


def mx_columns(data: torch.Tensor, scale: torch.Tensor, fmt: str | ElementFormat) -> ColumnMatrix:
    """MX weights (ops/mx.py storage, as `mx_exact` takes them; K a multiple of 32) in the column products' order:
    per matrix, blocks of 64 output columns, each [K/2][64][2] codes (E4M3) or [K/2][64] bytes (E2M1, element 2p
    in the low nibble: the stored bytes as they are), then the scales as [K/32][64] per block; columns past N zero
    codes and scale 0. Raises ValueError when `mx_exact` says no."""
    fmt = element_format(fmt)
    if not mx_exact(data, scale, fmt):
        raise ValueError(f"mx_columns: these {fmt.name} weights are outside the range the kernels decode exactly")
    *lead, N, G = scale.shape
    K, nb = G * BLOCK, -(-N // 64)
    pad = (0, 0, 0, nb * 64 - N)
    raw = data.view(torch.uint8)
    if fmt is E4M3:  # [.., N, K] -> [.., nb, 64, K/2, 2] -> [.., nb, K/2, 64, 2]
        blocks = torch.nn.functional.pad(raw, pad).reshape(*lead, nb, 64, K // 2, 2).transpose(-3, -2)
    else:  # [.., N, K/2] -> [.., nb, 64, K/2] -> [.., nb, K/2, 64]
        blocks = torch.nn.functional.pad(raw, pad).reshape(*lead, nb, 64, K // 2).transpose(-2, -1)
    scales = torch.nn.functional.pad(scale, pad).reshape(*lead, nb, 64, G).transpose(-2, -1)
    packed = huge_page_empty(tuple(blocks.shape), torch.uint8).copy_(blocks)
    return ColumnMatrix(packed, scales.contiguous(), _MAT_OF[fmt.name], (*lead, N, K))


def mx_stored(m: ColumnMatrix) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `mx_columns`: (data, scale) in ops/mx.py's storage (float8 E4M3 [..., N, K] or packed FP4
    uint8 [..., N, K/2], scales [..., N, K/32])."""
    *lead, N, K = m.shape
    if m.format == MAT_E4M3:
        data = m.data.transpose(-3, -2).reshape(*lead, -1, K)[..., :N, :].contiguous().view(torch.float8_e4m3fn)
    else:
        data = m.data.transpose(-2, -1).reshape(*lead, -1, K // 2)[..., :N, :].contiguous()
    scale = m.scales.transpose(-2, -1).reshape(*lead, -1, K // BLOCK)[..., :N, :].contiguous()
    return data, scale


def _matrix_ok(m: ColumnMatrix, shape: tuple[int, ...]) -> bool:
    return tuple(m.shape) == tuple(shape) and m.data.is_contiguous() and (m.scales is None or m.scales.is_contiguous())


def mx_unpack_block(m: ColumnMatrix, b: int) -> torch.Tensor:
    """Block b of a single matrix decoded by the kernels: bf16 [K/2, 64, 2] (pack_columns' block layout)."""
    K = m.shape[-1]
    out = torch.empty((K + 1) // 2, 64, 2, dtype=torch.bfloat16)
    native_library().ds_mx_unpack_block(m.struct(), K, b, out.data_ptr())
    return out


def mx_quantize_rows(x: torch.Tensor, mode: ScaleMode) -> torch.Tensor:
    """fake_quantize_mx(x, E4M3, mode) of bf16 rows x [M, K] (contiguous rows, K a multiple of 32) on the kernels:
    equal to it bit for bit (native_src/mx.c mx_quantize_row)."""
    M, K = x.shape
    if not (_rows(x) and K % BLOCK == 0):
        raise ValueError("mx_quantize_rows takes bf16 x [M, K] with contiguous rows and K a multiple of 32")
    out = torch.empty(M, K, dtype=torch.bfloat16)
    native_library().ds_mx_quantize_rows(x.data_ptr(), M, K, x.stride(0), ACT_OF[ScaleMode(mode)], out.data_ptr(),
                                         torch.get_num_threads())
    return out


def linear_mx(x: torch.Tensor, w: ColumnMatrix, tiles: bool = True) -> torch.Tensor:
    """x [M, K] (bf16, contiguous rows) @ W^T for a ColumnMatrix W [N, K], its inputs quantised as `w.act` says:
    the twin of ops/mx_linear.py `mx_linear_ref` (dequantised weights, fp32 sums, one rounding to bf16), up to the
    order of the sums (native_src/experts.c ds_mx_linear). Returns [M, N] bf16."""
    M, K = x.shape
    N = w.shape[0]
    if not (_rows(x) and len(w.shape) == 2 and _matrix_ok(w, (N, K))):
        raise ValueError("linear_mx takes bf16 x [M, K] with contiguous rows and a ColumnMatrix [N, K]")
    y = torch.empty(M, N, dtype=torch.bfloat16)
    if M and native_library().ds_mx_linear(x.data_ptr(), M, x.stride(0), K, w.struct(), N, y.data_ptr(), tiles,
                                           torch.get_num_threads()):
        raise ValueError(f"linear_mx: K = {K} is not whole MX blocks of {BLOCK}")
    return y


def moe_mx(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1: ColumnMatrix, w3: ColumnMatrix,
           w2: ColumnMatrix, situ: tuple[float, float | None] | None = None,
           shared: tuple[ColumnMatrix, ColumnMatrix, ColumnMatrix] | None = None,
           tiles: bool = True) -> torch.Tensor:
    """`moe_bf16` over ColumnMatrix stacks w1/w3 [E, I, D] and w2 [E, D, I] (bf16 or MX, each product quantising
    its inputs as its matrix says; w1 and w3 alike), with an optional shared expert (gate [IS, D], up [IS, D],
    down [D, IS] ColumnMatrices): the twin of layers/quantized.py MXExperts (plus the MoE's shared MLP over
    MXLinears, or bf16 Linears) up to the order of the fp32 sums (native_src/experts.c ds_mx_moe)."""
    T, D = x.shape
    E, I, _ = w1.shape
    if not (x.is_contiguous() and _rows(x) and _matrix_ok(w1, (E, I, D)) and _matrix_ok(w3, (E, I, D))
            and _matrix_ok(w2, (E, D, I))):
        raise ValueError("moe_mx takes contiguous bf16 x [T, D] and ColumnMatrix stacks w1/w3 [E, I, D], w2 [E, D, I]")
    IS, structs = 0, [None, None, None]
    if shared is not None:
        IS = shared[0].shape[0]
        if not all(_matrix_ok(m, s) for m, s in zip(shared, ((IS, D), (IS, D), (D, IS)))):
            raise ValueError("moe_mx: a shared expert is gate [IS, D], up [IS, D] and down [D, IS] ColumnMatrices")
        structs = [m.struct() for m in shared]
    experts = experts.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    if experts.shape != weights.shape or experts.shape[0] != T:
        raise ValueError("moe_mx: experts and weights must both be [T, k]")
    out = torch.empty(T, D, dtype=torch.bfloat16)
    bad = native_library().ds_mx_moe(x.data_ptr(), T, D, experts.data_ptr(), weights.data_ptr(), experts.shape[1],
                                     w1.struct(), w3.struct(), w2.struct(), E, I, situ is not None,
                                     situ[0] if situ else 0.0,
                                     float("nan") if situ is None or situ[1] is None else situ[1], *structs, IS,
                                     tiles, out.data_ptr(), torch.get_num_threads())
    if bad == -1:
        raise ValueError(f"moe_mx: expert ids must lie in [0, {E})")
    if bad:
        raise ValueError("moe_mx: gate and up must quantise their inputs alike, and MX matrices need K a multiple "
                         f"of {BLOCK}")
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` for fp32 CPU rows x [B, V] with contiguous rows (the first of equal maxima, the first NaN
    where a row has one), on the native kernel (native_src/sampling.c); torch's argmax, its twin, otherwise."""
    lib = native_library()
    if lib is None or not (x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1
                           and x.shape[1] > 0):
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.ds_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def rmsnorm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of bf16 rows x [M, D] (contiguous rows) with a bf16 weight [D], in the reference rounding order
    (layers/norm.py); returns a fresh [M, D] bf16 tensor."""
    if not (_rows(x) and weight.dtype == torch.bfloat16 and weight.is_contiguous() and weight.shape == x.shape[1:]):
        raise ValueError("rmsnorm_bf16 takes bf16 x [M, D] with contiguous rows and a contiguous bf16 weight [D]")
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    native_library().ds_rmsnorm_bf16(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), weight.data_ptr(), eps,
                                     out.data_ptr(), torch.get_num_threads())
    return out


def gated_rmsnorm_bf16(core: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA's o_norm (layers/norm.py `gated_rms_norm` of core cast to bf16) for fp32 core [R, K] and bf16 gate rows
    [R, K] (contiguous rows); returns [R, K] bf16."""
    R, K = core.shape
    if not (core.dtype == torch.float32 and core.is_contiguous() and _rows(gate) and gate.shape == core.shape
            and weight.shape == (K,)):
        raise ValueError("gated_rmsnorm_bf16 takes fp32 core [R, K], bf16 gate rows [R, K] and a weight [K]")
    w = weight.detach().float().contiguous()
    out = torch.empty(R, K, dtype=torch.bfloat16)
    native_library().ds_gated_rmsnorm_bf16(core.data_ptr(), R, K, gate.data_ptr(), gate.stride(0), w.data_ptr(), eps,
                                           out.data_ptr(), torch.get_num_threads())
    return out


def router_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, softmax: bool, groups: int,
                topk_group: int, renorm: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE router (layers/moe.py `Router`, docs/model.md §10) of bf16 rows x [T, D] (contiguous rows) against the
    fp32 weight [E, D] and correction bias [E]: (experts int64 [T, k], weights fp32 [T, k])."""
    T, D = x.shape
    E = weight.shape[0]
    if not (_rows(x) and weight.dtype == bias.dtype == torch.float32 and weight.is_contiguous()
            and weight.shape == (E, D) and bias.shape == (E,) and bias.is_contiguous()):
        raise ValueError("router_bf16 takes bf16 x [T, D] with contiguous rows, an fp32 weight [E, D] and bias [E]")
    experts = torch.empty(T, k, dtype=torch.int64)
    weights = torch.empty(T, k, dtype=torch.float32)
    if native_library().ds_router(x.data_ptr(), T, D, x.stride(0), weight.data_ptr(), bias.data_ptr(), E, softmax,
                                  groups, topk_group, k, renorm, scale, experts.data_ptr(), weights.data_ptr(),
                                  torch.get_num_threads()):
        raise ValueError(f"router_bf16: top-{k} of {E} experts in {groups} groups (keeping {topk_group}) is not valid")
    return experts, weights


def moe_bf16(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
             w2: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
             situ: tuple[float, float | None] | None = None,
             shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
             tiles: bool = True) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]) with gated experts stacked as w1/w3 [E, I, D] and
    w2 [E, D, I] (bf16, contiguous); experts int64 [T, k], weights fp32 [T, k]. Returns bf16 [T, D]. With
    `packed` (`pack_rows` of w1, w3, w2: the dot-product tiles, or `pack_columns` of them: the outer-product
    kernel) the kernel reads those; w1/w3/w2 then give the shapes. The activation is SiLU-GLU, or SiTU with
    `situ` = (beta, linear_beta or None) (ops/activation.py). `shared` = (`pack_columns` of a shared MLP's gate
    [IS, D], up [IS, D] and down [D, IS] weights, IS), with column-packed experts only: every token also runs
    through that MLP in the same pass, and the result is the two outputs, each rounded to bf16, summed in bf16
    (routed + shared, as the MoE block adds them). `tiles` as in `linear_columns`, for column-packed experts: an
    expert with TILE_MIN_ROWS tokens or more runs on the AMX tile unit where the CPU has one."""
    T, D = x.shape
    E, I, _ = w1.shape
    if not (x.is_contiguous() and _rows(x) and w1.shape == w3.shape == (E, I, D) and w2.shape == (E, D, I)):
        raise ValueError("moe_bf16 takes contiguous bf16 x [T, D], w1/w3 [E, I, D] and w2 [E, D, I]")
    mats = packed if packed is not None else (w1, w3, w2)
    if not all(w.dtype == torch.bfloat16 and w.is_contiguous() for w in mats):
        raise ValueError("moe_bf16 takes contiguous bf16 expert weights")
    layout = 0
    if packed is not None:
        shapes = [tuple(p.shape) for p in packed]
        for layout, shape_of in ((1, packed_shape), (2, column_packed_shape)):
            if shapes == [shape_of(w.shape) for w in (w1, w3, w2)]:
                break
        else:
            raise ValueError("moe_bf16: packed weights must be pack_rows or pack_columns of w1, w3 and w2")
    shared_ptrs, IS = [None, None, None], 0
    if shared is not None:
        *smats, IS = shared
        want = [column_packed_shape(s) for s in ((IS, D), (IS, D), (D, IS))]
        if layout != 2 or [tuple(m.shape) for m in smats] != want or not all(
                m.dtype == torch.bfloat16 and m.is_contiguous() for m in smats):
            raise ValueError("moe_bf16: a shared expert needs column-packed experts and pack_columns of its "
                             "gate [IS, D], up [IS, D] and down [D, IS] weights")
        shared_ptrs = [m.data_ptr() for m in smats]
    experts = experts.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    if experts.shape != weights.shape or experts.shape[0] != T:
        raise ValueError("moe_bf16: experts and weights must both be [T, k]")
    k = experts.shape[1]
    out = torch.empty(T, D, dtype=torch.bfloat16)
    h = torch.empty(T * k, I, dtype=torch.bfloat16)
    bad = native_library().ds_moe_bf16(x.data_ptr(), T, D, experts.data_ptr(), weights.data_ptr(), k,
                                       mats[0].data_ptr(), mats[1].data_ptr(), mats[2].data_ptr(), E, I,
                                       layout, situ is not None, situ[0] if situ else 0.0,
                                       float("nan") if situ is None or situ[1] is None else situ[1], *shared_ptrs,
                                       IS, tiles, h.data_ptr(), out.data_ptr(), torch.get_num_threads())
    if bad:
        raise ValueError(f"moe_bf16: expert ids must lie in [0, {E})")
    return out

