"""The image processor (docs/vision.md §2): bytes in, the tower's patches and the prompt's placeholder run out.

  decode (Pillow; a size, pixel-count and format check: ImageError naming what is wrong) -> RGB -> resize that only
  ever downscales ("NaViT": within in_patch_limit patches and patch_limit_on_one_side patches a side, bicubic) ->
  pad right and bottom to a multiple of merge x patch with zero bytes -> normalise per channel -> patches
  [gh·gw, 3, p, p] in raster order, channel-first, rows inside a patch row-major.

The constants come from the checkpoint's preprocessor_config.json (`media_proc_cfg`), never from here
(`MediaConfig.load`)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..errors import ConfigError, DeltaserveError


class ImageError(DeltaserveError, ValueError):
    """An image that cannot be used: not an image, corrupt or truncated, or over a cap. The message names why."""


@dataclass(frozen=True)
class MediaConfig:
    patch_size: int
    merge_kernel_size: int
    in_patch_limit: int
    patch_limit_on_one_side: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    fixed_output_tokens: int | None = None

    @classmethod
    def load(cls, model_dir: Path) -> "MediaConfig":
        """`media_proc_cfg` of the folder's preprocessor_config.json; ConfigError naming a missing key."""
        path = Path(model_dir) / "preprocessor_config.json"
        try:
            cfg = json.loads(path.read_text())["media_proc_cfg"]
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"{path}: no readable media_proc_cfg ({exc})") from exc
        if cfg.get("transparent_bg_config") is not None:
            raise ConfigError(f"{path}: transparent_bg_config is not supported yet (how images with alpha are "
                              f"composited would differ from the model's training)")
        try:
            merge = cfg["merge_kernel_size"]
            return cls(int(cfg["patch_size"]), int(merge[0] if isinstance(merge, list) else merge),
                       int(cfg["in_patch_limit"]), int(cfg["patch_limit_on_one_side"]),
                       tuple(map(float, cfg["image_mean"])), tuple(map(float, cfg["image_std"])),
                       cfg.get("fixed_output_tokens"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{path}: media_proc_cfg lacks or mistypes {exc}") from exc


@dataclass(frozen=True)
class ImageLimits:
    """Caps on one image, checked before it is decoded past its header."""

    max_bytes: int = 20 << 20
    max_pixels: int = 50_000_000


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: torch.Tensor  # [gh·gw, 3, p, p] fp32
    grid: tuple[int, int, int]  # (t, gh, gw)
    num_tokens: int  # placeholder positions: gh·gw / merge²
    size: tuple[int, int]  # the uploaded (width, height)
    digest: str  # sha256 of the uploaded bytes (of a Pillow image's pixels): the encoder and prefix caches' key


def navit_size(width: int, height: int, c: MediaConfig) -> tuple[int, int]:
    """The size an image is resized to (never larger than it is): within in_patch_limit patches in all and
    patch_limit_on_one_side patches a side."""
    p, side = c.patch_size, c.patch_limit_on_one_side
    scale = min(1.0, math.sqrt(c.in_patch_limit / (max(1, width // p) * max(1, height // p))),
                side * p / width, side * p / height)
    return (min(max(1, math.floor(width * scale)), side * p), min(max(1, math.floor(height * scale)), side * p))


def padded_grid(width: int, height: int, c: MediaConfig) -> tuple[int, int]:
    """(gh, gw): the patch grid of a resized image padded right and bottom to a multiple of merge x patch."""
    f = c.merge_kernel_size * c.patch_size
    return (height + (f - height % f) % f) // c.patch_size, (width + (f - width % f) % f) // c.patch_size


def decode_image(data: bytes, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """The image in `data`, fully decoded; ImageError naming why not."""
    if len(data) > limits.max_bytes:
        raise ImageError(f"the image has {len(data)} bytes; the limit is {limits.max_bytes}")
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > limits.max_pixels:
            raise ImageError(f"the image is {image.width}x{image.height} pixels; the limit is {limits.max_pixels}")
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image.load()
    except ImageError:
        raise
    except Exception as exc:  # noqa: BLE001 — Pillow raises many kinds for corrupt or unknown data
        raise ImageError(f"the data is not a readable image ({type(exc).__name__}: {exc})") from None
    if image.width < 1 or image.height < 1:
        raise ImageError("the image is empty")
    return image


def preprocess(data: "bytes | Image.Image", c: MediaConfig, limits: ImageLimits = ImageLimits()) -> ProcessedImage:
    """Decode (bytes; a Pillow image is taken as it is), convert, resize, pad, normalise and patchify one image."""
    if isinstance(data, Image.Image):
        image = data
        if image.width * image.height > limits.max_pixels:
            raise ImageError(f"the image is {image.width}x{image.height} pixels; the limit is {limits.max_pixels}")
        digest = hashlib.sha256(f"{image.mode}|{image.size}|".encode() + image.tobytes()).hexdigest()
    else:
        image, digest = decode_image(data, limits), hashlib.sha256(data).hexdigest()
    width, height = image.size
    rgb = image.convert("RGB")
    new_w, new_h = navit_size(width, height, c)
    if (new_w, new_h) != (width, height):
        rgb = rgb.resize((new_w, new_h), Image.Resampling.BICUBIC)
    gh, gw = padded_grid(new_w, new_h, c)
    p = c.patch_size
    pixels = np.zeros((gh * p, gw * p, 3), dtype=np.uint8)  # padding: zero bytes before normalisation
    pixels[:new_h, :new_w] = np.asarray(rgb, dtype=np.uint8)
    mean, std = torch.tensor(c.image_mean), torch.tensor(c.image_std)
    x = (torch.from_numpy(pixels).float() / 255 - mean) / std  # [H, W, 3]
    patches = x.view(gh, p, gw, p, 3).permute(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
    tokens = c.fixed_output_tokens or gh * gw // c.merge_kernel_size ** 2
    return ProcessedImage(patches.contiguous(), (1, gh, gw), tokens, (width, height), digest)


def placeholder_text(image: ProcessedImage) -> str:
    """The text between the media markers (docs/vision.md §6): `image WxH`, the uploaded size."""
    return f"image {image.size[0]}x{image.size[1]}"


def expand_placeholder(image: ProcessedImage, begin: int, content: int, pad: int, end: int, encode) -> list[int]:
    """The token ids one image's placeholder becomes: begin, the size text (`encode`d as ordinary text), content,
    `num_tokens` pads (the positions the projector's outputs replace), end."""
    return [begin, *encode(placeholder_text(image)), content, *[pad] * image.num_tokens, end]


IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"  # the chat renderer's one marker per image (docs/vision.md §6)
MEDIA_MARKERS = ("<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>")


def expand_prompt(text: str, images: list[ProcessedImage], tokenizer) -> list[int]:
    """The token ids of a text prompt holding one IMAGE_PLACEHOLDER per image, in order: the text around them
    encoded as the engine encodes prompts, each placeholder replaced by its image's run (`expand_placeholder`).
    ImageError when the counts differ or the tokenizer lacks a media marker."""
    parts = text.split(IMAGE_PLACEHOLDER)
    if len(parts) - 1 != len(images):
        raise ImageError(f"the prompt has {len(parts) - 1} image placeholders ({IMAGE_PLACEHOLDER}) for "
                         f"{len(images)} images")
    markers = []
    for marker in MEDIA_MARKERS:
        ids = tokenizer.encode(marker, allow_special=True)
        if len(ids) != 1:
            raise ImageError(f"the tokenizer has no special token {marker}: this model does not take images")
        markers += ids
    out = tokenizer.encode(parts[0], allow_special=True)
    for image, part in zip(images, parts[1:]):
        out += expand_placeholder(image, *markers, tokenizer.encode)
        out += tokenizer.encode(part, allow_special=True)
    return out


def image_part_run(part, c: MediaConfig, tokenizer, images: list[ProcessedImage],
                   fetched: dict[str, bytes] | None = None) -> list[int]:
    """A chat renderer's `image_ids`: an image content part decoded and processed (appended to `images`), and the
    ids of its media run; ImageError naming why not."""
    image = preprocess(image_part_data(part, fetched=fetched), c)
    images.append(image)
    return expand_prompt(IMAGE_PLACEHOLDER, [image], tokenizer)


def image_part_url(part) -> str | None:
    """The URL of an OpenAI image content part (`{"type": "image_url", "image_url": {"url": ...}}`, or `image`)."""
    url = part.get("image_url") if part.get("type") == "image_url" else part.get("image")
    url = url.get("url") if isinstance(url, dict) else url
    return url if isinstance(url, str) else None


def image_part_data(part, max_bytes: int = ImageLimits.max_bytes, fetched: dict[str, bytes] | None = None) -> bytes:
    """The bytes of an OpenAI image content part: its base64 data URL decoded, or for a remote URL the bytes
    `fetched` holds for it (a server fetches only the domains it is told to: one that fetched any URL could be
    pointed at any address); ImageError naming why not."""
    url = image_part_url(part)
    if url is None:
        raise ImageError("the image part has no URL (image_url.url)")
    if url.startswith(("http://", "https://")):
        if fetched and url in fetched:
            return fetched[url]
        raise ImageError("remote image URLs are fetched only from the server's --allowed-media-domains; send the "
                         "image as a data URL (data:image/png;base64,...)")
    head, sep, body = url.partition(",")
    if not (sep and head.startswith("data:") and head.endswith(";base64")):
        raise ImageError("the image URL must be a base64 data URL (data:image/...;base64,...)")
    if len(body) > 4 * (max_bytes // 3 + 1):
        raise ImageError(f"the image's data URL holds more than {max_bytes} bytes")
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"the image's data URL is not valid base64 ({exc})") from None
