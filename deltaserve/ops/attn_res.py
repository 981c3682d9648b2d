"""AttnRes mixing over depth (docs/model.md §5.2).

`attn_res_mix_ref` is the readable formula; `attn_res_mix` computes the same in plain torch with GEMVs and in-place
accumulation; `attn_res_mix_native` mixes bf16 CPU sources in one native call (native_src/attention.c
`ds_attn_res_mix`: a K3 decode step mixes twice a layer, and the torch form's ~8 small ops a source were most of a
k31-small step's op count) and runs `attn_res_mix` for any other input.
"""

import ctypes

import torch

from . import native


def attn_res_mix_ref(sources: list[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
    """Mix `sources` (each [N, d], model dtype) with softmax weights over depth.

    s_i = rsqrt(mean(V_i^2) + eps) * <V_i, norm_weight * query>, alpha = softmax_i(s), out = sum_i alpha_i V_i
    (raw values are mixed, fp32 math, result rounded to the sources' dtype). One source returns it unchanged.
    """
    if len(sources) == 1:
        return sources[0]
    c = norm_weight.float() * query.float()
    logits = []
    for v in sources:
        vf = v.float()
        logits.append(torch.rsqrt(vf.pow(2).mean(-1) + eps) * (vf * c).sum(-1))
    alpha = torch.softmax(torch.stack(logits, 0), dim=0)
    out = sum(a.unsqueeze(-1) * v.float() for a, v in zip(alpha, sources))
    return out.to(sources[0].dtype)


def attn_res_mix(sources: list[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """Same contract as `attn_res_mix_ref`: each source's logit is one GEMV (V_i @ c) and one norm over the whole
    flattened batch, and the mixture is accumulated in place (no stacked copy of the sources). Plain torch."""
    if len(sources) == 1:
        return sources[0]
    c = norm_weight.float() * query.float()
    d = sources[0].shape[-1]
    logits = torch.stack([torch.rsqrt(v.float().pow(2).sum(-1) / d + eps) * (v.float() @ c) for v in sources], 0)
    alpha = torch.softmax(logits, dim=0)
    out = sources[0].float() * alpha[0].unsqueeze(-1)
    for a, v in zip(alpha[1:], sources[1:]):
        out.addcmul_(v.float(), a.unsqueeze(-1))
    return out.to(sources[0].dtype)


def attn_res_mix_native(sources: list[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """Same contract as `attn_res_mix_ref`: one native call for bf16 CPU sources (`_native_mix`), the fp32 mixture
    rounded once to bf16; `attn_res_mix` otherwise."""
    if len(sources) == 1:
        return sources[0]
    if not _native_mix(sources, query, norm_weight):
        return attn_res_mix(sources, query, norm_weight, eps)
    N, d = sources[0].shape
    out = torch.empty(N, d, dtype=torch.bfloat16)
    addresses = (ctypes.c_int64 * len(sources))(*(v.data_ptr() for v in sources))
    native.native_library().ds_attn_res_mix(addresses, len(sources), N, d, norm_weight.data_ptr(),
                                            query.data_ptr(), eps, out.data_ptr(), torch.get_num_threads())
    return out


def _native_mix(sources: list[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    """bf16 CPU sources [N, d] of one shape, each contiguous, bf16 contiguous query and weight [d], kernels built."""
    first = sources[0]
    return (first.dtype == torch.bfloat16 and first.device.type == "cpu" and first.dim() == 2
            and all(v.shape == first.shape and v.dtype == torch.bfloat16 and v.is_contiguous() for v in sources)
            and query.dtype == norm_weight.dtype == torch.bfloat16 and query.is_contiguous()
            and norm_weight.is_contiguous() and query.shape == norm_weight.shape == first.shape[1:]
            and native.native_library() is not None)
