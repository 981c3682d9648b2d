"""Train a DSpark drafter (deltaserve/models/dspark.py, docs/serving.md §9.4) for a target model, on the target's
own training corpus, and write it as a drafter folder (config.json with model_type k3_dspark, model.safetensors,
training.json).

    python -m deltaserve.tools.train_dspark --target deltaserve/data/default_model --tokens WORK/tokens.safetensors \
        --out deltaserve/data/default_model/dspark --work /tmp/dspark-train

The target is frozen. Each step takes random windows of the token stream, runs the target once over them (its
pre-norm states are the drafter's context, its distributions the drafter's teacher), samples `--anchors` anchor
positions per window and drafts a block after each, teacher-forced (the Markov head sees the true token before each
slot's target). The loss is DeepSpec's: `--l1-weight` x the L1 distance between the drafter's and the target's
next-token distributions (twice the total variation: 1 - TV is the chance a draft survives verification) plus
`--ce-weight` x the cross-entropy on the true tokens, slot k weighted exp(-k / `--decay`). AdamW, cosine LR,
deterministic given `--seed`, resumable from `--work`/state.safetensors (safetensors + JSON, never pickle).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ..models.dspark import DSparkConfig, DSparkDrafter, block_visibility
from ..models.loader import load_model
from .train import _load_training_state, _save_training_state, lr_at, step_batch


def drafter_config(target, block_size: int, num_layers: int, markov_rank: int, mask_token_id: int) -> DSparkConfig:
    """A drafter shaped after `target`'s attention (its hidden size, heads, ranks and head dims; RoPE on the k_pe
    part) with `num_layers` layers and a dense MLP of the target's dense width."""
    c = target.config
    return DSparkConfig(hidden_size=c.hidden_size, num_hidden_layers=num_layers, num_attention_heads=c.num_heads,
                        q_lora_rank=c.q_lora_rank or c.kv_lora_rank, kv_lora_rank=c.kv_lora_rank,
                        qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
                        v_head_dim=c.v_head_dim, intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
                        context_dim=c.hidden_size, block_size=block_size, mask_token_id=mask_token_id,
                        markov_rank=markov_rank)


def block_logits(drafter: DSparkDrafter, target, tokens: torch.Tensor, states: torch.Tensor, anchors: torch.Tensor,
                 previous: torch.Tensor) -> torch.Tensor:
    """Draft logits [A, G, V] of the blocks after `anchors` in one sequence (`tokens` [T], the target's pre-norm
    states [T, d]); `previous` [A, G]: the token before each slot's target (the anchor, then the true tokens)."""
    c = drafter.config
    T, A, G = tokens.shape[0], anchors.shape[0], c.block_size
    contexts = drafter.context_latents(states, torch.arange(T))
    positions = (anchors.unsqueeze(1) + torch.arange(G)).reshape(-1)
    ids = torch.full((A, G), c.mask_token_id, dtype=torch.long)
    ids[:, 0] = tokens[anchors]
    out = drafter.block_states(target.embed_tokens(ids.reshape(-1)), positions, contexts,
                               block_visibility(anchors, T, G))
    return target.lm_head(out).float().view(A, G, -1) + drafter.markov_bias(previous)


def dspark_loss(drafter: DSparkDrafter, target, windows: torch.Tensor, num_anchors: int, gen: torch.Generator,
                ce_weight: float, l1_weight: float, decay: float) -> tuple[torch.Tensor, float]:
    """(loss, mean expected survival of a slot's draft, 1 - TV) over `windows` [B, T] (module docstring)."""
    B, T = windows.shape
    G = drafter.config.block_size
    with torch.no_grad():
        states = target(windows.reshape(-1), step_batch(B, T))
        teacher = target.compute_logits(states).float().softmax(-1).view(B, T, -1)
    slot_weight = torch.exp(-torch.arange(G, dtype=torch.float32) / decay)
    total, survival, counted = 0.0, 0.0, 0.0
    for b in range(B):
        seq = windows[b]
        anchors = torch.randperm(T - 1, generator=gen)[:num_anchors].sort().values
        label_at = anchors.unsqueeze(1) + torch.arange(1, G + 1)
        valid = label_at < T
        safe = label_at.clamp(max=T - 1)
        labels = seq[safe]
        previous = torch.cat([seq[anchors].unsqueeze(1), labels[:, :-1]], dim=1)
        logits = block_logits(drafter, target, seq, states[b * T:(b + 1) * T], anchors, previous)
        w = valid.float() * slot_weight
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        l1 = (logits.softmax(-1) - teacher[b][safe - 1]).abs().sum(-1)
        total = total + (ce_weight * (ce.view_as(w) * w).sum() + l1_weight * (l1 * w).sum()) / w.sum()
        survival += ((1 - 0.5 * l1.detach()) * valid).sum().item()
        counted += valid.sum().item()
    return total / B, survival / max(counted, 1.0)


def export_drafter(drafter: DSparkDrafter, out: Path, extra: dict) -> None:
    """config.json + model.safetensors (bf16) + training.json, written through temporary names."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors.tmp"))
    (out / "model.safetensors.tmp").replace(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({**drafter.config.to_dict(), "torch_dtype": "bfloat16"}, indent=2))
    (out / "training.json").write_text(json.dumps(extra, indent=2))


def main(argv: list[str] | None = None) -> None:
    from tqdm import tqdm

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True, help="the target model folder")
    ap.add_argument("--tokens", type=Path, required=True, help="the token stream (train.py's WORK/tokens.safetensors)")
    ap.add_argument("--out", type=Path, required=True, help="the drafter folder written")
    ap.add_argument("--work", type=Path, default=Path("/tmp/dspark-train"), help="resumable state")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--markov-rank", type=int, default=64)
    ap.add_argument("--mask-token-id", type=int, default=None, help="default: the vocabulary's last id")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--anchors", type=int, default=64, help="blocks drafted per window")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ce-weight", type=float, default=0.1)
    ap.add_argument("--l1-weight", type=float, default=0.9)
    ap.add_argument("--decay", type=float, default=4.0, help="slot k's loss weight is exp(-k / decay)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    target = load_model(args.target, dtype="float32")
    target.requires_grad_(False)
    target.eval()
    mask = args.mask_token_id if args.mask_token_id is not None else target.config.vocab_size - 1
    torch.manual_seed(args.seed)
    drafter = DSparkDrafter(drafter_config(target, args.block_size, args.layers, args.markov_rank, mask))
    tokens = load_file(str(args.tokens))["tokens"].long()
    decay = [p for n, p in drafter.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in drafter.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)
    state_path = args.work / "state.safetensors"
    step, seconds, losses, survivals = 0, 0.0, [], []
    if state_path.exists():
        meta = _load_training_state(state_path, drafter, opt, gen)
        step, seconds, losses, survivals = meta["step"], meta["seconds"], meta["losses"], meta["survivals"]
    print(f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M params; {len(tokens)} tokens")

    def checkpoint() -> None:
        info = {"step": step, "seconds": seconds, "losses": losses, "survivals": survivals}
        _save_training_state(state_path, drafter, opt, gen, info)
        recent = survivals[-50:]
        export_drafter(drafter, args.out, {"step": step, "train_seconds": round(seconds), "seed": args.seed,
                                           "batch": args.batch, "seq_len": args.seq_len, "anchors": args.anchors,
                                           "lr": args.lr, "ce_weight": args.ce_weight, "l1_weight": args.l1_weight,
                                           "decay": args.decay, "steps_planned": args.steps,
                                           "survival_last50": round(sum(recent) / max(1, len(recent)), 4)})

    drafter.train()
    bar = tqdm(total=args.steps, initial=step, dynamic_ncols=True, unit="step")
    n = len(tokens) - args.seq_len
    while step < args.steps:
        t0 = time.perf_counter()
        starts = torch.randint(0, n, (args.batch,), generator=gen)
        windows = torch.stack([tokens[s:s + args.seq_len] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, 20)
        loss, survival = dspark_loss(drafter, target, windows, args.anchors, gen, args.ce_weight, args.l1_weight,
                                     args.decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        seconds += time.perf_counter() - t0
        losses.append(round(loss.item(), 4))
        survivals.append(round(survival, 4))
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", survival=f"{survival:.3f}")
        if step % args.ckpt_every == 0 or step == args.steps:
            checkpoint()
    bar.close()
    recent = survivals[-50:]
    print(f"done: {step} steps, {seconds:.0f}s; last-50 survival {sum(recent) / max(1, len(recent)):.3f}")


if __name__ == "__main__":
    main()
