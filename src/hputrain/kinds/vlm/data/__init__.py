"""Image data for vision-language models: TRL's image rows (rows.py), encoded with the image
tokens expanded as the model's processor expands them (encode.py), images resized into a few
pixel buckets of one token count (buckets.py), packed into fixed blocks (blocks.py), training and
validation blocks of a data set (loading.py)."""
from .blocks import BlockStats, ImageBlocks, ImageCollator
from .buckets import Buckets, make_buckets
from .encode import ImageExample, ImageStats, Processing, check_fits, encode_row, encode_split
from .loading import ImageData, load_image_data
from .rows import ImageRef, detect_image_format, open_image, split_rows

__all__ = ["BlockStats", "Buckets", "ImageBlocks", "ImageCollator", "ImageData", "ImageExample",
           "ImageRef", "ImageStats", "Processing", "check_fits", "detect_image_format", "encode_row",
           "encode_split", "load_image_data", "make_buckets", "open_image", "split_rows"]
