"""The DSpark drafter (deltaserve/models/dspark.py) and its training (deltaserve/tools/train_dspark.py): which keys a
block sees, the Markov head's bias, and a short training run that lowers the loss and writes a drafter folder."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from deltaserve.errors import ConfigError
from deltaserve.models.dspark import DSparkConfig, DSparkDrafter, block_visibility
from deltaserve.models.loader import load_model
from deltaserve.tools import train_dspark
from deltaserve.tools.train import _load

CONFIG = DSparkConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                      qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, intermediate_size=48, vocab_size=50,
                      context_dim=32, block_size=3, mask_token_id=49, markov_rank=4)


def _drafter(config: DSparkConfig = CONFIG) -> DSparkDrafter:
    torch.manual_seed(0)
    drafter = DSparkDrafter(config)
    for p in drafter.parameters():  # norms at 1, everything else small and random
        if p.ndim >= 2:
            torch.nn.init.normal_(p, std=0.2)
    return drafter


def test_block_visibility():
    seen = block_visibility(torch.tensor([2, 4]), 5, 3)
    assert seen.shape == (6, 11)
    assert seen[:3, :5].tolist() == [[True, True, False, False, False]] * 3  # block 0: context before its anchor
    assert seen[3:, :5].tolist() == [[True, True, True, True, False]] * 3
    assert seen[:3, 5:].tolist() == [[True] * 3 + [False] * 3] * 3  # every row of its own block, not causal
    assert seen[3:, 5:].tolist() == [[False] * 3 + [True] * 3] * 3


@torch.no_grad()
def test_a_block_reads_only_the_context_before_its_anchor():
    drafter = _drafter()
    T, anchor = 10, 6
    states = torch.randn(T, CONFIG.context_dim)
    embeds = torch.randn(CONFIG.block_size, CONFIG.hidden_size)
    positions = anchor + torch.arange(CONFIG.block_size)
    visible = block_visibility(torch.tensor([anchor]), T, CONFIG.block_size)

    def run(s):
        return drafter.block_states(embeds, positions, drafter.context_latents(s, torch.arange(T)), visible)

    base = run(states)
    later = states.clone()
    later[anchor:] += 5.0  # positions at and after the anchor: not context
    assert torch.equal(run(later), base)
    earlier = states.clone()
    earlier[anchor - 1] += 1.0
    assert not torch.allclose(run(earlier), base)


@torch.no_grad()
def test_blocks_batched_in_absorbed_form_are_the_plain_forward():
    """Serving's form (several blocks at once, contexts padded to one length, attention in MLA's absorbed form) gives
    each block the states of the plain forward over its own context: fp32, contexts of 0, 3 and 9 rows, padding
    rows filled with noise that no block may see."""
    drafter = _drafter()
    G, T = CONFIG.block_size, 9
    anchors = torch.tensor([3, 9, 0])
    states = [torch.randn(int(P), CONFIG.context_dim) for P in anchors]
    embeds = torch.randn(len(anchors), G, CONFIG.hidden_size)
    positions = anchors.unsqueeze(1) + torch.arange(G)
    padded = [torch.randn(len(anchors), T, CONFIG.kv_lora_rank + CONFIG.qk_rope_head_dim) * 3
              for _ in range(CONFIG.num_hidden_layers)]
    for b, P in enumerate(anchors.tolist()):
        for layer, rows in enumerate(drafter.context_latents(states[b], torch.arange(P))):
            padded[layer][b, :P] = rows
    batched = drafter.block_states_batched(embeds, positions, padded, anchors)
    for b, P in enumerate(anchors.tolist()):
        plain = drafter.block_states(embeds[b], positions[b], drafter.context_latents(states[b], torch.arange(P)),
                                     block_visibility(torch.tensor([P]), P, G))
        torch.testing.assert_close(batched[b], plain, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_markov_bias_is_w2_of_w1_of_the_previous_token():
    drafter = _drafter()
    prev = torch.tensor([[3, 7], [0, 49]])
    want = drafter.markov_w1.weight[prev] @ drafter.markov_w2.weight.T
    torch.testing.assert_close(drafter.markov_bias(prev), want)
    assert drafter.markov_bias(prev).shape == (2, 2, CONFIG.vocab_size)
    plain = DSparkDrafter(DSparkConfig.from_dict({**CONFIG.to_dict(), "markov_rank": 0}))
    assert plain.markov_bias(prev) == 0.0


def test_config_round_trip_and_errors():
    raw = CONFIG.to_dict()
    assert DSparkConfig.from_dict(raw) == CONFIG
    with pytest.raises(ConfigError, match="model_type"):
        DSparkConfig.from_dict({**raw, "model_type": "deepseek_v3"})
    with pytest.raises(ConfigError, match="block_size"):
        DSparkConfig.from_dict({k: v for k, v in raw.items() if k != "block_size"})
    with pytest.raises(ConfigError, match="mask_token_id"):
        DSparkConfig.from_dict({**raw, "mask_token_id": 50})


def test_training_lowers_the_loss_and_writes_a_drafter(make_checkpoint, tmp_path):
    """Twenty steps on k31-tiny's own random-token stream: the loss falls, and the folder holds the config, the
    drafter's tensors (bf16) and the run's figures; a second run resumes from the state instead of starting over."""
    path = make_checkpoint("k31-tiny")
    target = load_model(path, dtype="float32")
    g = torch.Generator().manual_seed(0)
    phrase = torch.randint(0, 200, (37,), generator=g)
    from safetensors.torch import save_file

    save_file({"tokens": phrase.repeat(60).to(torch.int32)}, str(tmp_path / "tokens.safetensors"))
    out, work = tmp_path / "drafter", tmp_path / "work"
    argv = ["--target", str(path), "--tokens", str(tmp_path / "tokens.safetensors"), "--out", str(out), "--work",
            str(work), "--steps", "20", "--batch", "2", "--seq-len", "64", "--anchors", "8", "--ckpt-every", "10",
            "--lr", "3e-3"]
    train_dspark.main(argv)
    meta = json.loads((out / "training.json").read_text())
    assert meta["step"] == 20
    state = _load(work / "state.safetensors")[1]
    losses = state["losses"]
    assert sum(losses[-5:]) < sum(losses[:5]), losses
    config = DSparkConfig.from_dict(json.loads((out / "config.json").read_text()))
    assert config.vocab_size == target.config.vocab_size and config.context_dim == target.config.hidden_size
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert all(f.get_tensor(n).dtype == torch.bfloat16 for n in names)
    assert names == set(DSparkDrafter(config).state_dict())
    train_dspark.main(argv[:-2] + ["--steps", "22", "--lr", "3e-3"])  # resumes at step 20
    assert json.loads((out / "training.json").read_text())["step"] == 22
    assert len(_load(work / "state.safetensors")[1]["losses"]) == 22
