"""Image files read by header before any pixel is decoded: what COCO images, video frame folders and evaluation
folders are checked with before a run or an evaluation starts (a file that is not an image, a decompression bomb,
a sample depth that attnlab's 8-bit pipeline would clip, a size other than the one declared)."""

from __future__ import annotations

import re
import warnings

from attnlab.errors import DatasetError

# The most pixels an image may have: 8192 x 8192, far above any benchmark's (ImageNet-R's largest are a few
# megapixels, COCO's 640 x 640) and below PIL's own 89-megapixel warning; a larger one is refused before decoding.
MAX_PIXELS = 1 << 26
# PIL modes of more than 8 bits per sample (16-bit greyscale PNGs, 32-bit integer and float images): convert("RGB")
# clips them to 255, so a 16-bit image would train as white
DEEP_MODES = ("I", "F", "I;16", "I;16B", "I;16L", "I;16N", "I;16S", "I;32", "I;32B", "I;32L", "F;32", "F;32B")


def open_image(path, what: str, max_pixels: int = MAX_PIXELS):
    """``path`` opened by PIL (its header read, no pixel decoded), or DatasetError naming it: not an image, or more
    than ``max_pixels`` pixels."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(path)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:  # PIL's own, larger limit
            image, pixels = None, re.search(r"\((\d+) pixels\)", str(err))
        except (OSError, SyntaxError, ValueError) as err:  # PIL's UnidentifiedImageError is an OSError
            raise DatasetError(f"{what} file {path} is not a readable image ({' '.join(str(err).split())[:120]}); "
                               "remove it or replace it with a PNG or JPEG.") from None
    if image is None or image.width * image.height > max_pixels:
        size = (f"{image.width} x {image.height} pixels" if image is not None
                else f"{int(pixels[1]):,} pixels" if pixels else "too many pixels to open")
        if image is not None:
            image.close()
        raise DatasetError(f"{what} file {path} has {size}, more than the {max_pixels:,} an image may have here (a "
                           f"decompression bomb?); remove it or shrink it.")
    return image


def image_size(path, what: str) -> tuple[int, int]:
    """(width, height) of the 8-bit image ``path`` from its header alone; DatasetError naming it for a file that is
    not an image, too many pixels, or more than 8 bits per sample (which the pipeline would clip to white)."""
    with open_image(path, what) as image:
        if image.mode in DEEP_MODES:
            raise DatasetError(f"{what} file {path} has {image.mode} pixels (more than 8 bits per sample), which "
                               f"would be clipped to 255 when read as RGB; convert it to 8 bits per channel (e.g. "
                               f"PIL's point(lambda v: v / 257).convert('L')).")
        return image.size


__all__ = ["DEEP_MODES", "MAX_PIXELS", "image_size", "open_image"]
