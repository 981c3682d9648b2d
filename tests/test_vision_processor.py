"""The image processor (deltaserve/vision/processor.py, docs/vision.md §2): sizes and token counts against the spec's
formulas and worked examples, the patch order, the padding value, colour modes, the config file, and a matrix of
images it must refuse naming why."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
from PIL import Image

from deltaserve.errors import ConfigError
from deltaserve.vision import (ImageError, ImageLimits, MediaConfig, expand_placeholder, navit_size, padded_grid,
                               preprocess)

K25 = MediaConfig(14, 2, 16384, 512, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
SMALL = MediaConfig(14, 2, 64, 16, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))


def _png(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def _spec_size(W, H, p, lim, side):
    """docs/vision.md §2.2-2.3 written out once more, literally."""
    s1 = math.sqrt(lim / (max(1, W // p) * max(1, H // p)))
    scale = min(1, s1, side * p / W, side * p / H)
    new_w, new_h = min(max(1, math.floor(W * scale)), side * p), min(max(1, math.floor(H * scale)), side * p)
    f = 2 * p
    PW, PH = new_w + (f - new_w % f) % f, new_h + (f - new_h % f) % f
    return (new_w, new_h), (PH // p, PW // p), (PH // f) * (PW // f)


@pytest.mark.parametrize("W, H", [(1, 1), (27, 29), (28, 28), (56, 84), (84, 56), (1024, 1536), (1536, 1024),
                                  (4000, 3000), (10000, 20), (20, 10000), (7168, 7168), (14, 14000)])
def test_sizes_and_token_counts_follow_the_spec(W, H):
    for c in (K25, SMALL):
        size, grid, tokens = _spec_size(W, H, c.patch_size, c.in_patch_limit, c.patch_limit_on_one_side)
        assert navit_size(W, H, c) == size
        assert padded_grid(*size, c) == grid
        assert grid[0] * grid[1] // 4 == tokens
        assert size[0] <= W and size[1] <= H and grid[0] <= c.patch_limit_on_one_side + 1


def test_the_worked_examples():
    assert padded_grid(*navit_size(1024, 1536, K25), K25) == (110, 74)  # 8140 patches, 2035 tokens
    img = preprocess(_png(Image.new("RGB", (84, 56))), K25)
    assert img.grid == (1, 4, 6) and img.pixel_values.shape == (24, 3, 14, 14) and img.num_tokens == 6


def test_patches_are_raster_order_channel_first_and_padding_is_zero_bytes():
    W, H = 50, 30  # padded to 56 x 56: 4 x 4 patches
    yy, xx = np.mgrid[0:H, 0:W]
    pixels = np.stack([(xx * 3 + yy) % 251, (xx + yy * 5) % 251, (xx * yy) % 251], axis=-1).astype(np.uint8)
    img = preprocess(_png(Image.fromarray(pixels, "RGB")), SMALL)  # mean 0, std 1: values are u8 / 255
    assert img.grid == (1, 4, 4) and img.size == (W, H)
    p = 14
    for y in range(0, 56, 5):
        for x in range(0, 56, 3):
            patch = img.pixel_values[(y // p) * 4 + x // p]
            want = pixels[y, x] / 255 if y < H and x < W else np.zeros(3)
            assert np.allclose(patch[:, y % p, x % p].numpy(), want, atol=1e-6), (x, y)
    normed = preprocess(_png(Image.fromarray(pixels, "RGB")), K25)  # mean = std = 0.5: a padding pixel is -1
    assert normed.pixel_values[15, :, 13, 13].eq(-1).all()


def test_an_image_within_the_limits_is_not_resampled():
    pixels = np.random.default_rng(0).integers(0, 256, (60, 70, 3), dtype=np.uint8)
    img = preprocess(_png(Image.fromarray(pixels, "RGB")), K25)
    back = (img.pixel_values * 0.5 + 0.5) * 255  # undo the normalisation
    rows = back.view(6, 6, 3, 14, 14).permute(0, 3, 1, 4, 2).reshape(84, 84, 3)
    assert np.array_equal(rows[:60, :70].round().numpy().astype(np.uint8), pixels)


@pytest.mark.parametrize("mode", ["L", "P", "CMYK", "RGBA", "LA", "I;16"])
def test_colour_modes_become_rgb_as_pillow_converts_them(mode):
    base = Image.fromarray(np.random.default_rng(1).integers(0, 256, (20, 20, 3), dtype=np.uint8), "RGB")
    image = base.convert(mode) if mode != "I;16" else base.convert("L").convert("I;16")
    fmt = "TIFF" if mode in ("CMYK", "I;16") else "PNG"
    data = _png(image, fmt)
    want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float32) / 255
    got = preprocess(data, SMALL).pixel_values.view(2, 2, 3, 14, 14).permute(0, 3, 1, 4, 2).reshape(28, 28, 3)
    assert np.allclose(got[:20, :20].numpy(), want, atol=1e-6)


def test_bad_images_are_refused_naming_why():
    png = _png(Image.new("RGB", (40, 40), (10, 20, 30)))
    cases = [(b"", "not a readable image"),
             (b"hello, not an image at all", "not a readable image"),
             (png[: len(png) // 2], "not a readable image"),  # truncated
             (b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, "not a readable image"),  # a PNG signature, then nothing
             (png, "the image has"),  # over a byte cap of 100
             (_png(Image.new("RGB", (400, 300))), "pixels; the limit is"),
             (_png(Image.new("RGB", (40, 40)), "GIF")[:30], "not a readable image"),
             (json.dumps({"not": "image"}).encode(), "not a readable image")]
    for data, needle in cases:
        limits = ImageLimits(max_bytes=100) if needle == "the image has" else ImageLimits(max_pixels=100_000)
        with pytest.raises(ImageError, match=needle):
            preprocess(data, SMALL, limits)


def test_media_config_comes_from_the_checkpoints_file(tmp_path):
    cfg = {"patch_size": 14, "merge_kernel_size": [2, 2], "in_patch_limit": 16384, "patch_limit_on_one_side": 256,
           "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "fixed_output_tokens": None}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": cfg}))
    assert MediaConfig.load(tmp_path) == MediaConfig(14, 2, 16384, 256, (0.5,) * 3, (0.5,) * 3, None)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": dict(cfg, transparent_bg_config={})}))
    with pytest.raises(ConfigError, match="transparent_bg_config is not supported"):
        MediaConfig.load(tmp_path)
    del cfg["image_std"]
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": cfg}))
    with pytest.raises(ConfigError, match="image_std"):
        MediaConfig.load(tmp_path)


def test_the_placeholder_run_names_the_uploaded_size():
    img = preprocess(_png(Image.new("RGB", (84, 56))), K25)
    ids = expand_placeholder(img, 1, 2, 3, 4, lambda text: [ord(ch) for ch in text])
    assert ids == [1, *map(ord, "image 84x56"), 2, 3, 3, 3, 3, 3, 3, 4]
