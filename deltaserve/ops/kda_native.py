"""KDA from the projections to the core output over state slots, in torch and on a native CPU kernel
(`native_src/attention.c`).

Both ops run, per token, the short convs of q̂ | k̂ | v̂ over the slot's window (SiLU), L2-normalised q and k and
the gated delta rule on the slot's state, everything in place in the state pools (docs/model.md §8.2, §8.5):

* `kda_decode_step`: one token for each of N sequences (the layers' decode step);
* `kda_step_varlen`: several tokens for each of several sequences (a round of the layers' varlen prefill).

Each op comes in three forms with one contract: `_ref` composes the ops' `_ref` twins; the plain name is the fast
torch form (batched decode ops; per-sequence convs + the chunked varlen form) and never calls the native library;
`_native` runs the native kernel where the library built and the tensors are CPU tensors in the layout it reads (a
work item per (sequence, head), token by token, each head's state staying in cache; for prefill this replaced the
chunked torch form, which spends its time in [C, C, K] decay temporaries on the CPU), the fast torch form otherwise.
`kda_gate_beta` (the layer's forget gate and beta) has the same three forms.

Arguments: ``x [T, 3P]`` the q̂ | k̂ | v̂ rows before the conv (P = H K), ``conv_weight [3P, W]`` fp32 (the three
conv weights stacked the same way), ``conv_states [num_slots, 3P, W-1]`` and ``recurrent_states [num_slots, H, K,
K]`` the layer's pool views, ``g [T, H, K]``, ``beta [T, H]``; ``cu_seqlens`` the token bounds of the sequences and
``slots`` one slot each (distinct; < 0 is padding: zero output, no state touched). Return ``o [T, H, K]`` fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import native
from .conv import short_conv, short_conv_ref
from .kda import kda_gate, l2_normalize
from .kda_batched import (_bounds, _check_distinct, _slot_list, kda_decode_batched, kda_decode_batched_ref,
                          kda_prefill_varlen, kda_prefill_varlen_ref, short_conv_decode_batched,
                          short_conv_decode_batched_ref)


def _normalised(y: Tensor, H: int, K: int) -> tuple[Tensor, Tensor, Tensor]:
    n, P = y.shape[0], H * K
    return (l2_normalize(y[:, :P].float().view(n, H, K)), l2_normalize(y[:, P:2 * P].float().view(n, H, K)),
            y[:, 2 * P:].float().view(n, H, K))


def _decode_composed(conv_op, delta_op, x, conv_weight, conv_states, g, beta, scale, recurrent_states, slots):
    N, H, K = g.shape
    y = conv_op(x, conv_weight, conv_states, slots)
    return delta_op(*_normalised(y, H, K), g, beta, scale, recurrent_states, slots)


def _varlen_composed(conv_op, prefill_op, x, conv_weight, conv_states, g, beta, scale, cu_seqlens,
                     recurrent_states, slots):
    H, K = g.shape[1], g.shape[2]
    cu, sl = _bounds(cu_seqlens), _slot_list(slots)
    ys = torch.zeros_like(x)
    for b, s in enumerate(sl):
        if s >= 0 and cu[b + 1] > cu[b]:
            ys[cu[b]:cu[b + 1]], window = conv_op(x[cu[b]:cu[b + 1]], conv_weight, conv_states[s])
            conv_states[s].copy_(window)
    return prefill_op(*_normalised(ys, H, K), g, beta, scale, torch.tensor(cu), recurrent_states, slots)


def kda_decode_step_ref(x: Tensor, conv_weight: Tensor, conv_states: Tensor, g: Tensor, beta: Tensor,
                        scale: float | None, recurrent_states: Tensor, slots: Tensor) -> Tensor:
    """Reference: the per-sequence conv and delta-rule references, composed."""
    return _decode_composed(short_conv_decode_batched_ref, kda_decode_batched_ref, x, conv_weight, conv_states, g,
                            beta, scale, recurrent_states, slots)


def kda_decode_step(x: Tensor, conv_weight: Tensor, conv_states: Tensor, g: Tensor, beta: Tensor,
                    scale: float | None, recurrent_states: Tensor, slots: Tensor) -> Tensor:
    """Fast twin of `kda_decode_step_ref` in torch: the batched conv and delta-rule decode ops."""
    return _decode_composed(short_conv_decode_batched, kda_decode_batched, x, conv_weight, conv_states, g, beta, scale,
                            recurrent_states, slots)


def kda_decode_step_native(x: Tensor, conv_weight: Tensor, conv_states: Tensor, g: Tensor, beta: Tensor,
                           scale: float | None, recurrent_states: Tensor, slots: Tensor) -> Tensor:
    """`kda_decode_step` on the native kernel (one token per sequence) where `_native_layout` holds, else the
    torch form."""
    if not _native_layout(x, conv_weight, conv_states, recurrent_states):
        return kda_decode_step(x, conv_weight, conv_states, g, beta, scale, recurrent_states, slots)
    return _native(x, conv_weight, conv_states, g, beta, scale, list(range(x.shape[0] + 1)), recurrent_states, slots)


def kda_step_varlen_ref(x: Tensor, conv_weight: Tensor, conv_states: Tensor, g: Tensor, beta: Tensor,
                        scale: float | None, cu_seqlens: Tensor, recurrent_states: Tensor, slots: Tensor) -> Tensor:
    """Reference: per-sequence reference convs, then the varlen delta-rule reference."""
    return _varlen_composed(short_conv_ref, kda_prefill_varlen_ref, x, conv_weight, conv_states, g, beta, scale,
                            cu_seqlens, recurrent_states, slots)


def kda_step_varlen(x: Tensor, conv_weight: Tensor, conv_states: Tensor, g: Tensor, beta: Tensor,
                    scale: float | None, cu_seqlens: Tensor, recurrent_states: Tensor, slots: Tensor) -> Tensor:
    """Fast twin of `kda_step_varlen_ref` in torch: per-sequence convs + the chunked varlen form."""
    _check_varlen(x, cu_seqlens, slots)
    return _varlen_composed(short_conv, kda_prefill_varlen, x, conv_weight, conv_states, g, beta, scale, cu_seqlens,
                            recurrent_states, slots)


def kda_step_varlen_native(x: Tensor, conv_weight: Tensor, conv_states: Tensor, g: Tensor, beta: Tensor,
                           scale: float | None, cu_seqlens: Tensor, recurrent_states: Tensor, slots: Tensor) -> Tensor:
    """`kda_step_varlen` on the native kernel where `_native_layout` holds, else the torch form."""
    if not _native_layout(x, conv_weight, conv_states, recurrent_states):
        return kda_step_varlen(x, conv_weight, conv_states, g, beta, scale, cu_seqlens, recurrent_states, slots)
    cu, sl = _check_varlen(x, cu_seqlens, slots)
    return _native(x, conv_weight, conv_states, g, beta, scale, cu, recurrent_states, sl)


def _check_varlen(x: Tensor, cu_seqlens: Tensor, slots: Tensor) -> tuple[list[int], list[int]]:
    """The bounds and slots as lists, after checking they describe x's tokens with distinct slots."""
    cu, sl = _bounds(cu_seqlens), _slot_list(slots)
    if len(sl) != len(cu) - 1 or cu[-1] != x.shape[0]:
        raise ValueError(f"{len(sl)} slots and cu_seqlens {cu} do not describe {x.shape[0]} tokens")
    _check_distinct(sl)
    return cu, sl


def kda_gate_beta_ref(u: Tensor, b: Tensor, dt_bias: Tensor, A_log: Tensor,
                      lower_bound: float | None) -> tuple[Tensor, Tensor]:
    """The layer's forget gate g [T, H, K] (ops/kda.py `kda_gate` of u + dt_bias) and beta = sigmoid(b) [T, H], fp32,
    from the f_b_proj output u [T, H K] and the b_proj output b [T, H]."""
    T, H = b.shape
    g = kda_gate((u.float() + dt_bias.float()).view(T, H, -1), A_log.float(), lower_bound)
    return g, torch.sigmoid(b.float())


def kda_gate_beta(u: Tensor, b: Tensor, dt_bias: Tensor, A_log: Tensor,
                  lower_bound: float | None) -> tuple[Tensor, Tensor]:
    """Fast twin of `kda_gate_beta_ref` in torch: the same fp32 operations in the same order (equal bit for bit),
    one [T, H, K] temporary fewer: the scale by exp(A_log) runs in place where autograd allows it (never on a
    tensor a backward reads: the model trains through this form)."""
    T, H = b.shape
    a = A_log.float().exp().view(1, -1, 1)
    x = torch.add(u.float(), dt_bias.float()).view(T, H, -1)  # a fresh tensor: u itself is never written
    if lower_bound is None:
        g = F.softplus(x, beta=1.0, threshold=20.0).mul_(-a)
    else:
        g = torch.sigmoid(x.mul_(a)) * lower_bound
    return g, torch.sigmoid(b.float())


def kda_gate_beta_native(u: Tensor, b: Tensor, dt_bias: Tensor, A_log: Tensor,
                         lower_bound: float | None) -> tuple[Tensor, Tensor]:
    """`kda_gate_beta` (equal to fp32 rounding) in one native call for bf16 rows on the CPU, else the torch form."""
    T, H = b.shape
    K = u.shape[1] // H
    if not (u.dtype == b.dtype == torch.bfloat16 and u.device.type == "cpu" and u.dim() == 2 and u.stride(1) == 1
            and b.stride(1) == 1 and u.shape == (T, H * K) and native.native_library() is not None):
        return kda_gate_beta(u, b, dt_bias, A_log, lower_bound)
    dt, a = dt_bias.detach().float().contiguous(), A_log.detach().float().contiguous()
    g, beta = torch.empty(T, H, K), torch.empty(T, H)
    native.native_library().ds_kda_gate(u.data_ptr(), u.stride(0), b.data_ptr(), b.stride(0), T, H, K, dt.data_ptr(),
                                        a.data_ptr(), float("nan") if lower_bound is None else lower_bound,
                                        g.data_ptr(), beta.data_ptr(), torch.get_num_threads())
    return g, beta


def _native(x, conv_weight, conv_states, g, beta, scale, cu: list[int], recurrent_states, slots) -> Tensor:
    T, H, K = g.shape
    out = torch.empty(T, H, K, dtype=torch.float32)
    if T == 0:
        return out
    g, beta = g.float().contiguous(), beta.float().contiguous()
    cu_t, slots_t = torch.tensor(cu, dtype=torch.int64), torch.as_tensor(slots, dtype=torch.int64).contiguous()
    native.native_library().ds_kda_step(
        slots_t.numel(), cu_t.data_ptr(), H, K, x.data_ptr(), x.stride(0), x.dtype == torch.bfloat16, conv_weight.data_ptr(),
        conv_weight.shape[1], conv_states.data_ptr(), conv_states.stride(0), g.data_ptr(), beta.data_ptr(),
        K ** -0.5 if scale is None else scale, recurrent_states.data_ptr(), recurrent_states.stride(0),
        slots_t.data_ptr(), None, out.data_ptr(), torch.get_num_threads())
    return out


def _native_layout(x: Tensor, conv_weight: Tensor, conv_states: Tensor, recurrent_states: Tensor) -> bool:
    """The kernels built and the tensors are CPU tensors in the layout the kernel reads."""
    H, K, W = recurrent_states.shape[1], recurrent_states.shape[2], conv_weight.shape[1]
    return (native.native_library() is not None and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1
            and x.dtype in (torch.bfloat16, torch.float32) and x.shape[1] == 3 * H * K
            and recurrent_states.shape[3] == K and conv_weight.dtype == torch.float32
            and conv_weight.is_contiguous() and conv_states.dtype == torch.float32
            and conv_states.stride()[1:] == (W - 1, 1) and recurrent_states.dtype == torch.float32
            and recurrent_states.stride()[1:] == (K * K, K, 1))
