"""Images into the model (docs/vision.md): the processor (decoding, resizing, patches, the placeholder run); the tower
that encodes the patches is models/vision.py."""

from .processor import (ImageError, ImageLimits, MediaConfig, ProcessedImage, expand_placeholder, navit_size,
                        padded_grid, preprocess)

__all__ = ["ImageError", "ImageLimits", "MediaConfig", "ProcessedImage", "expand_placeholder", "navit_size",
           "padded_grid", "preprocess"]
