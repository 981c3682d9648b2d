"""Images into the model (docs/vision.md): the processor (decoding, resizing, patches, the placeholder run); the tower
that encodes the patches is models/vision.py."""

from .processor import (IMAGE_PLACEHOLDER, ImageError, ImageLimits, MediaConfig, ProcessedImage, expand_placeholder,
                        expand_prompt, image_part_data, image_part_run, image_part_url,
                        navit_size, padded_grid, preprocess)

__all__ = ["IMAGE_PLACEHOLDER", "ImageError", "ImageLimits", "MediaConfig", "ProcessedImage", "expand_placeholder",
           "expand_prompt", "image_part_data", "image_part_run", "image_part_url",
           "navit_size", "padded_grid", "preprocess"]
