"""One KDA decode token for many sequences, from the projections to the core output (model.md §8.2, §8.5):
short convs over the slots' windows, L2-normalised q and k, the gated delta rule on the slots' states, all in
place in the state pools. The layers' decode step is this one op.

``x [N, 3P]`` holds q̂ | k̂ | v̂ before the conv (P = H K), ``conv_weight [3P, W]`` the three conv weights stacked
the same way, ``conv_states [num_slots, 3P, W-1]`` and ``recurrent_states [num_slots, H, K, K]`` the layer's pool
views; ``g [N, H, K]``, ``beta [N, H]`` fp32. A slot < 0 is padding (zero output, no state touched). Returns
``o [N, H, K]`` fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import native
from .kda import l2_normalize
from .kda_batched import (kda_decode_batched, kda_decode_batched_ref, short_conv_decode_batched,
                          short_conv_decode_batched_ref)


def _composed(conv_op, delta_op, x: Tensor, conv_weight: Tensor, conv_states: Tensor, g: Tensor, beta: Tensor,
              scale: float | None, recurrent_states: Tensor, slots: Tensor) -> Tensor:
    N, H, K = g.shape
    P = H * K
    y = conv_op(x, conv_weight, conv_states, slots)
    q = l2_normalize(y[:, :P].float().view(N, H, K))
    k = l2_normalize(y[:, P:2 * P].float().view(N, H, K))
    v = y[:, 2 * P:].float().view(N, H, K)
    return delta_op(q, k, v, g, beta, scale, recurrent_states, slots)


def kda_decode_step_ref(x: Tensor, conv_weight: Tensor, conv_states: Tensor, g: Tensor, beta: Tensor,
                        scale: float | None, recurrent_states: Tensor, slots: Tensor) -> Tensor:
    """Reference: the per-sequence conv and delta-rule references, composed."""
    return _composed(short_conv_decode_batched_ref, kda_decode_batched_ref, x, conv_weight, conv_states, g, beta,
                     scale, recurrent_states, slots)


def kda_decode_step(x: Tensor, conv_weight: Tensor, conv_states: Tensor, g: Tensor, beta: Tensor,
                    scale: float | None, recurrent_states: Tensor, slots: Tensor) -> Tensor:
    """Fast twin: one native call (a work item per sequence and head, every state read and written once) when
    the kernels built and the pools are fp32 CPU tensors in the layout above; else the batched torch ops."""
    N, H, K = g.shape
    W = conv_weight.shape[1]
    if not _native_layout(x, conv_weight, conv_states, recurrent_states, W):
        return _composed(short_conv_decode_batched, kda_decode_batched, x, conv_weight, conv_states, g, beta,
                         scale, recurrent_states, slots)
    out = torch.empty(N, H, K, dtype=torch.float32)
    if N == 0:
        return out
    g, beta = g.float().contiguous(), beta.float().contiguous()
    slots = torch.as_tensor(slots, dtype=torch.int64).contiguous()
    native.native_library().ds_kda_decode(
        N, H, K, x.data_ptr(), x.stride(0), x.dtype == torch.bfloat16, conv_weight.data_ptr(), W,
        conv_states.data_ptr(), conv_states.stride(0), g.data_ptr(), beta.data_ptr(),
        K ** -0.5 if scale is None else scale, recurrent_states.data_ptr(), recurrent_states.stride(0),
        slots.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


def _native_layout(x: Tensor, conv_weight: Tensor, conv_states: Tensor, recurrent_states: Tensor, W: int) -> bool:
    C, H, K = x.shape[1], recurrent_states.shape[1], recurrent_states.shape[2]
    return (native.native_library() is not None and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1
            and x.dtype in (torch.bfloat16, torch.float32) and C == 3 * H * K
            and recurrent_states.shape[3] == K
            and conv_weight.dtype == torch.float32 and conv_weight.is_contiguous()
            and conv_states.dtype == torch.float32 and conv_states.stride()[1:] == (W - 1, 1)
            and recurrent_states.dtype == torch.float32 and recurrent_states.stride()[1:] == (K * K, K, 1))
