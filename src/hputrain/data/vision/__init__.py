"""Image data for vision-language models: TRL's image rows (rows.py), encoded with the image
tokens expanded as the model's processor expands them (encode.py), images resized into a few
pixel buckets of one token count (buckets.py), packed into fixed blocks (blocks.py)."""
from .buckets import Buckets, make_buckets
from .encode import ImageExample, ImageStats, Processing, check_fits, encode_row, encode_split
from .rows import ImageRef, detect_image_format, open_image, split_rows

__all__ = ["Buckets", "ImageExample", "ImageRef", "ImageStats", "Processing", "check_fits",
           "detect_image_format", "encode_row", "encode_split", "make_buckets", "open_image",
           "split_rows"]
