"""The vision tower (deltaserve/models/vision.py, docs/vision.md): the K2.5-shaped tower and projector against
transformers 5.23.0 `kimi_k25` (random tiny weights, fp32, images and a two-frame clip in one batch), and the parts
where K3's MoonViT-V2 differs checked against the spec's formulas."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from deltaserve.models.vision import (Projector, VisionBlock, VisionConfig, VisionTower, apply_rope, merge,
                                      position_table, rope_angles, time_table)

TINY = dict(patch_size=14, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4, num_layers=2, hidden_size=64,
            num_heads=4, intermediate_size=96, text_hidden_size=48)
GRIDS = [(1, 4, 6), (1, 6, 4), (2, 4, 4)]


def _pixels(grids, seed=0):
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 3, 14, 14, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_k25_tower_and_projector_match_transformers():
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25MultimodalProjection, Kimi_K25VisionModel

    hf_config = Kimi_K25VisionConfig(patch_size=14, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4,
                                     num_attention_heads=4, num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                                     rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = Kimi_K25VisionModel(hf_config).eval()
    for p in hf.parameters():  # the init leaves norms at 1/0 and some tables at 0: make every weight count
        p.normal_(0, 0.2)
    holder = SimpleNamespace(vision_config=hf_config, text_config=SimpleNamespace(hidden_size=48),
                             projection_hidden_size=64, projection_layer_norm_eps=1e-5)
    hf_proj = Kimi_K25MultimodalProjection(holder).eval()
    for p in hf_proj.parameters():
        p.normal_(0, 0.2)

    c = VisionConfig(variant="k25", pos_emb_mode="bicubic", qkv_size=64, **TINY)
    ours, proj = VisionTower(c).eval(), Projector(c).eval()
    sd = hf.state_dict()
    ours.patch_embed.proj.load_state_dict({k.removeprefix("patch_embed.proj."): v for k, v in sd.items()
                                           if k.startswith("patch_embed.proj.")})
    ours.patch_embed.pos_emb.weight.copy_(sd["patch_embed.pos_emb.position_embeddings"])
    for i, block in enumerate(ours.encoder.blocks):
        pre = f"layers.{i}."
        for mine, theirs in ((block.norm0, "norm1"), (block.norm1, "norm2"), (block.wo, "attn.proj"),
                             (block.mlp.fc0, "mlp.fc1"), (block.mlp.fc1, "mlp.fc2")):
            mine.weight.copy_(sd[pre + theirs + ".weight"])
            mine.bias.copy_(sd[pre + theirs + ".bias"])
        for part in ("weight", "bias"):
            getattr(block.wqkv, part).copy_(torch.cat([sd[f"{pre}attn.{x}_proj.{part}"] for x in "qkv"]))
    ours.encoder.final_layernorm.weight.copy_(sd["final_layernorm.weight"])
    ours.encoder.final_layernorm.bias.copy_(sd["final_layernorm.bias"])
    for mine, theirs in ((proj.pre_norm, hf_proj.pre_norm), (proj.proj[0], hf_proj.in_proj),
                         (proj.proj[2], hf_proj.out_proj)):
        mine.load_state_dict(theirs.state_dict())

    for grids in (GRIDS[:2], GRIDS[2:]):  # its merge takes images or clips of one length per call
        pixels = _pixels(grids)
        want = hf_proj(hf(pixels, grid_thw=torch.tensor(grids)).pooler_output)
        got = proj(ours(pixels, grids))
        assert got.shape == (sum(h * w // 4 for _, h, w in grids), 48)
        torch.testing.assert_close(got, want.reshape(got.shape), rtol=1e-4, atol=1e-4)


def test_position_table_is_itself_at_its_size_and_interpolate_elsewhere():
    table = torch.randn(8, 8, 16)
    assert torch.equal(position_table(table, 8, 8, "bilinear"), table.reshape(64, 16))
    for mode in ("bilinear", "bicubic"):
        want = F.interpolate(table.permute(2, 0, 1)[None], size=(4, 6), mode=mode, align_corners=False)
        assert torch.allclose(position_table(table, 4, 6, mode), want[0].permute(1, 2, 0).reshape(24, 16))


def test_time_rows_follow_the_formula_and_row_zero_is_not_zero():
    rows = time_table(4, 8)
    for tau in range(4):
        for i in range(4):
            w = 10000 ** (-i / 4)  # w_i = 10000^(-2i / dim), dim 8
            assert math.isclose(rows[tau, i], math.sin(tau * w), abs_tol=1e-6)
            assert math.isclose(rows[tau, 4 + i], math.cos(tau * w), abs_tol=1e-6)
    assert rows[0, 4:].eq(1).all()  # which is why an image (t = 1) gets no time row at all


def test_k3_rope_pairs_adjacent_channels_keeps_norms_and_sees_only_offsets():
    head_dim = 16
    angles = rope_angles(5, 7, head_dim, 10000.0)
    y, x = 2, 3  # row 2, column 3 of a 5 x 7 grid
    f = [10000 ** (-4 * i / head_dim) for i in range(head_dim // 4)]
    assert torch.allclose(angles[y * 7 + x], torch.tensor([v for fi in f for v in (x * fi, y * fi)]))
    q = torch.randn(35, 2, head_dim)
    rotated = apply_rope(q, angles, adjacent=True)
    assert torch.allclose(rotated.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    c, s = angles[y * 7 + x, 0].cos(), angles[y * 7 + x, 0].sin()  # pair (0, 1) turns by x·f_0
    a, b = q[y * 7 + x, 0, 0], q[y * 7 + x, 0, 1]
    assert torch.allclose(rotated[y * 7 + x, 0, :2], torch.stack([a * c - b * s, a * s + b * c]), atol=1e-6)
    one, two = torch.randn(head_dim), torch.randn(head_dim)

    def dot(p, r):  # <rope(one at p), rope(two at r)> for grid positions p, r
        qa = apply_rope(one.expand(35, 1, head_dim), angles, True)[p, 0]
        kb = apply_rope(two.expand(35, 1, head_dim), angles, True)[r, 0]
        return (qa * kb).sum()

    assert torch.allclose(dot(0 * 7 + 1, 1 * 7 + 3), dot(2 * 7 + 2, 3 * 7 + 4), atol=1e-5)  # offset (1, 2) twice


def test_merge_groups_2x2_windows_row_major_and_averages_frames():
    t, gh, gw = 2, 4, 6
    ids = torch.arange(t * gh * gw, dtype=torch.float32)
    tt, yy, xx = ids // (gh * gw), (ids % (gh * gw)) // gw, ids % gw
    x = torch.stack([tt, yy, xx], dim=-1)  # each token encodes (frame, row, col)
    out = merge(x, [(t, gh, gw)], (2, 2)).view(-1, 4, 3)
    assert out.shape[0] == (gh // 2) * (gw // 2)
    group = out[1 * (gw // 2) + 2]  # merged row 1, column 2
    assert group[:, 0].eq(0.5).all()  # frames 0 and 1 averaged
    assert group[:, 1:].tolist() == [[2, 4], [2, 5], [3, 4], [3, 5]]


def test_k3_norms_use_the_input_dtypes_epsilon():
    """RMSNorm with eps=None: 2^-7 in bf16 (the reference builds its ViT norms so), 1.19e-7 in fp32."""
    c = VisionConfig(**TINY)
    block = VisionBlock(c)
    x = torch.full((1, 64), 0.01)
    for dtype, eps in ((torch.float32, torch.finfo(torch.float32).eps), (torch.bfloat16, 2 ** -7)):
        got = block.norm0.to(dtype)(x.to(dtype)).float()
        want = 0.01 / math.sqrt(1e-4 + eps)
        assert math.isclose(got[0, 0].item(), want, rel_tol=1e-2), (dtype, got[0, 0].item(), want)


def test_k3_projector_has_no_pre_norm_and_ends_in_rms_norm():
    c = VisionConfig(**TINY)
    proj = Projector(c)
    for p in proj.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    g = torch.randn(5, 256)
    z = proj.proj[2].weight @ F.gelu(proj.proj[0].weight @ g.T, approximate="none")
    want = (z.T / torch.sqrt(z.T.pow(2).mean(-1, keepdim=True) + c.projector_ln_eps)) * proj.post_norm.weight
    assert proj.pre_norm is None and proj.proj[0].bias is None
    torch.testing.assert_close(proj(g), want, rtol=1e-5, atol=1e-5)


def test_a_tower_config_that_cannot_split_its_heads_is_refused():
    from deltaserve.errors import ConfigError

    with pytest.raises(ConfigError, match="qkv_size 100"):
        VisionConfig(qkv_size=100, num_heads=12)


def test_parameter_names_are_the_checkpoints():
    """docs/vision.md: the K3 tower's and projector's tensors under `vision_tower.` and `mm_projector.`."""
    c = VisionConfig(**TINY)
    names = {f"vision_tower.{n}": tuple(p.shape) for n, p in VisionTower(c).named_parameters()}
    names |= {f"mm_projector.{n}": tuple(p.shape) for n, p in Projector(c).named_parameters()}
    want = {"vision_tower.patch_embed.proj.weight": (64, 3, 14, 14),
            "vision_tower.patch_embed.pos_emb.weight": (8, 8, 64),
            "vision_tower.encoder.final_layernorm.weight": (64,),
            "mm_projector.proj.0.weight": (256, 256), "mm_projector.proj.2.weight": (48, 256),
            "mm_projector.post_norm.weight": (48,)}
    for i in range(2):
        want |= {f"vision_tower.encoder.blocks.{i}.norm0.weight": (64,),
                 f"vision_tower.encoder.blocks.{i}.norm1.weight": (64,),
                 f"vision_tower.encoder.blocks.{i}.wqkv.weight": (3 * 1536, 64),
                 f"vision_tower.encoder.blocks.{i}.wo.weight": (64, 1536),
                 f"vision_tower.encoder.blocks.{i}.mlp.fc0.weight": (96, 64),
                 f"vision_tower.encoder.blocks.{i}.mlp.fc1.weight": (64, 96)}
    assert names == want


@torch.no_grad()
def test_k3_items_in_one_batch_do_not_see_each_other():
    """Two images and a clip through the K3 tower at once give each one's output alone (attention stays within an
    item; positions restart per item)."""
    c = VisionConfig(**dict(TINY, qkv_size=128))
    torch.manual_seed(1)
    tower, proj = VisionTower(c).eval(), Projector(c).eval()
    for p in (*tower.parameters(), *proj.parameters()):
        p.normal_(0, 0.2)
    pixels = _pixels(GRIDS, seed=3)
    together = proj(tower(pixels, GRIDS))
    alone, start = [], 0
    for t, h, w in GRIDS:
        alone.append(proj(tower(pixels[start:start + t * h * w], [(t, h, w)])))
        start += t * h * w
    torch.testing.assert_close(together, torch.cat(alone), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_make_model_writes_a_tower_that_loads_and_encodes_an_image(make_checkpoint, tmp_path):
    """`k3-tiny-vision`: its vision tensors and preprocessor_config.json load (`load_vision`), hold the parameter
    count of the spec's formula, and an uploaded PNG goes through the processor and the tower to one text-width
    row per placeholder position; vLLM's projector names load the same; a missing or mis-shaped tensor and an
    unsupported vision_config value are refused naming them."""
    import io
    import json
    import shutil

    from PIL import Image
    from safetensors.torch import load_file, save_file

    from deltaserve.errors import CheckpointError, ConfigError
    from deltaserve.models.vision import load_vision
    from deltaserve.vision import MediaConfig, preprocess

    path = make_checkpoint("k3-tiny-vision")
    vision = load_vision(path)
    c = vision.config
    D, Q, I, p = c.hidden_size, c.qkv_size, c.intermediate_size, c.patch_size
    tower = c.num_layers * (D * 3 * Q + Q * D + 2 * D * I + 2 * D) + 3 * p * p * D + 8 * 8 * D + D
    projector = (4 * D) ** 2 + 4 * D * c.text_hidden_size + c.text_hidden_size
    assert sum(t.numel() for t in vision.parameters()) == tower + projector
    png = io.BytesIO()
    Image.new("RGB", (100, 60), (200, 30, 90)).save(png, format="PNG")
    image = preprocess(png.getvalue(), MediaConfig.load(path))
    out = vision.encode(image.pixel_values, [image.grid])
    assert out.shape == (image.num_tokens, 64) and torch.isfinite(out).all()

    renamed = tmp_path / "renamed"
    shutil.copytree(path, renamed)
    tensors = load_file(renamed / "model.safetensors")
    for old, new in (("mm_projector.proj.0.", "mm_projector.linear_1."), ("mm_projector.proj.2.", "mm_projector.linear_2.")):
        for name in [n for n in tensors if n.startswith(old)]:
            tensors[new + name[len(old):]] = tensors.pop(name)
    save_file(tensors, renamed / "model.safetensors")
    assert torch.equal(load_vision(renamed).encode(image.pixel_values, [image.grid]), out)
    del tensors["vision_tower.encoder.blocks.1.wo.weight"]
    save_file(tensors, renamed / "model.safetensors")
    with pytest.raises(CheckpointError, match="lacks vision tensor 'vision_tower.encoder.blocks.1.wo.weight'"):
        load_vision(renamed)
    tensors["vision_tower.encoder.blocks.1.wo.weight"] = torch.zeros(3, 3)
    save_file(tensors, renamed / "model.safetensors")
    with pytest.raises(CheckpointError, match="blocks.1.wo.weight' is \\[3, 3\\]"):
        load_vision(renamed)
    raw = json.loads((path / "config.json").read_text())
    raw["vision_config"]["merge_type"] = "sd2"
    (renamed / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="merge_type 'sd2' is not supported"):
        load_vision(renamed)


@torch.no_grad()
def test_features_replace_exactly_the_pad_rows_and_survive_a_chunk_split_inside_them(make_checkpoint):
    """docs/vision.md: the k-th pad position takes the k-th projector output; rows given by the batch replace those
    tokens' embeddings and no others (a run whose pads keep their token embeddings differs from the image run,
    the text before the image does not); computed in two chunks through the paged cache, the second starting inside
    the pad run, the logits are the single forward's."""
    import io

    from PIL import Image

    from deltaserve.cache.page_pool import PagePool
    from deltaserve.cache.paged_cache import PagedCache, SeqHandle
    from deltaserve.cache.state_slots import StateSlots
    from deltaserve.layers.batch import StepBatch
    from deltaserve.models.loader import load_model
    from deltaserve.models.vision import load_vision
    from deltaserve.vision import MediaConfig, preprocess

    path = make_checkpoint("k3-tiny-vision")
    model, vision = load_model(path, "float32"), load_vision(path)
    png = io.BytesIO()
    Image.new("RGB", (90, 70), (40, 160, 220)).save(png, format="PNG")
    image = preprocess(png.getvalue(), MediaConfig.load(path))
    features = vision.encode(image.pixel_values, [image.grid])
    pad = model.config.vocab_size - 1  # any id: the rows are replaced
    ids = torch.tensor([5, 9, 11] + [pad] * image.num_tokens + [17, 3, 8])
    rows = torch.arange(3, 3 + image.num_tokens)
    full = model.compute_logits(model(ids, dataclasses_replace(StepBatch.single(len(ids)), (rows, features))))
    plain = model.reference_logits(ids)
    torch.testing.assert_close(full[:3], plain[:3], rtol=1e-5, atol=1e-5)  # the text before the image: as without it
    assert (full[3:] - plain[3:]).abs().amax() > 1e-2  # the image rows and all after them see the features

    cache = PagedCache(PagePool(model.config, 4, 16, torch.float32), StateSlots(model.config, 1))
    table = torch.arange(4 * 16)
    cut = 3 + image.num_tokens // 2  # the second chunk starts inside the pad run
    logits = []
    for start, end in ((0, cut), (cut, len(ids))):
        batch = StepBatch(torch.arange(start, end), [0, end - start], [start], cache, [SeqHandle(0, table[:end])],
                          write_rows=table[start:end])
        inside = (rows >= start) & (rows < end)
        batch = dataclasses_replace(batch, (rows[inside] - start, features[inside]))
        logits.append(model.compute_logits(model(ids[start:end], batch)))
    torch.testing.assert_close(torch.cat(logits), full, rtol=1e-4, atol=1e-4)


def dataclasses_replace(batch, input_embeds):
    import dataclasses

    return dataclasses.replace(batch, input_embeds=input_embeds)
