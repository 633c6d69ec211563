"""Images in prompt data: what a record may hold, how it becomes a `Sample`'s reference, and the checks.

A record's image field (``data.image_key``) is one image or a list of them, each
- a path, absolute or relative to the data file's folder (stored absolute);
- a ``data:image/<type>;base64,...`` URI (JSONL's way to carry the bytes);
- bytes (a Parquet binary column), or ``{"bytes": ..., "path": ...}`` (the Hugging Face ``datasets`` Image
  feature as Parquet stores it): the bytes become a data URI, so a `Sample` stays JSON-safe.
URLs are refused: a run reads no network (download the images and give their paths).

Each check names the record (``where``: file:line or file:row N) and the fix, as text data's do.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

from slime_rl.core.run.data import DataError

#: data.max_image_pixels's default: 4096 x 4096. The processor resizes every image down to its own bound
#: anyway; this refuses files whose decoding alone would take hundreds of MB (a 30,000 x 30,000 PNG is 2.7 GB).
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
DATA_URI_PREFIX = "data:"


class ImageProblem(Exception):
    """Why one image is unusable (the caller adds where it is). A plain exception, not a frozen dataclass: it must survive the pickle round trip that carries it
    across Ray (tests/unit/test_errors_pickle.py)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def image_refs(value: Any, where: str, *, base_dir: Path, key: str) -> list[str]:
    """The references (absolute paths or data URIs) of a record's image field ``value``; DataError when a
    value is of no form the module doc lists."""
    items = value if isinstance(value, list) else [value]
    if not items:
        return []
    refs = []
    for k, item in enumerate(items):
        label = f"image {k} of {key!r}" if isinstance(value, list) else f"image {key!r}"
        if isinstance(item, dict) and ("bytes" in item or "path" in item):
            item = item.get("bytes") or item.get("path")
        if isinstance(item, bytes | bytearray):
            if not item:
                raise DataError(where, f"{label} is empty bytes; give the image file's bytes or its path")
            refs.append(bytes_to_data_uri(bytes(item)))
        elif isinstance(item, str) and item.startswith(DATA_URI_PREFIX):
            refs.append(item)
        elif isinstance(item, str) and item.strip():
            if item.startswith(("http://", "https://")):
                raise DataError(where, f"{label} is a URL ({item[:80]}); a run reads no network: download the "
                                       f"image and give its path")
            path = Path(item).expanduser()
            refs.append(str(path if path.is_absolute() else (base_dir / path).resolve()))
        else:
            shown = type(item).__name__ if not isinstance(item, str) else "an empty string"
            raise DataError(where, f"{label} is {shown}; give a path, a data:image/...;base64 URI or bytes "
                                   f"(docs/vlm.md)")
    return refs


def bytes_to_data_uri(data: bytes) -> str:
    """``data`` (an encoded image file) as a data URI; its type from the file's own header when PIL knows it."""
    kind = "png"
    try:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as image:
            kind = (image.format or "png").lower()
    except Exception:  # unreadable bytes: check_image says so, with where they are
        pass
    return f"data:image/{kind};base64,{base64.b64encode(data).decode('ascii')}"


def read_bytes(ref: str) -> bytes:
    """The encoded file behind a reference (a path or a data URI); ImageProblem when there is none."""
    if ref.startswith(DATA_URI_PREFIX):
        header, _, payload = ref.partition(",")
        if ";base64" not in header:
            raise ImageProblem("is a data URI without ;base64 (only base64 data URIs are read)")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageProblem("is a data URI whose payload is not valid base64") from None
    path = Path(ref)
    if not path.exists():
        raise ImageProblem(f"{ref}: no such file; fix the path (relative paths are read from the data file's "
                           f"folder)")
    if not path.is_file():
        raise ImageProblem(f"{ref}: not a file; give an image file's path")
    try:
        return path.read_bytes()
    except OSError as err:
        raise ImageProblem(f"{ref}: cannot be read ({err.strerror or err}); fix its permissions") from None


def open_image(ref: str, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, decode: bool = True) -> Any:
    """The image behind ``ref`` as an RGB PIL image (``decode=False``: only its header read, for the up-front
    check); ImageProblem when it is missing, unreadable or larger than ``max_pixels``."""
    from PIL import Image, UnidentifiedImageError

    data = read_bytes(ref)
    shown = ref if not ref.startswith(DATA_URI_PREFIX) else "the data URI"
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageProblem(f"{shown}: not an image file PIL can read ({len(data)} bytes); give a PNG, JPEG, WebP, "
                           f"GIF or BMP file") from None
    width, height = image.size
    if width * height > max_pixels:
        raise ImageProblem(f"{shown}: {width}x{height} is {width * height:,} pixels, over data.max_image_pixels="
                           f"{max_pixels:,}; downscale the image or raise data.max_image_pixels")
    if width < 1 or height < 1:
        raise ImageProblem(f"{shown}: has no pixels ({width}x{height})")
    try:
        if not decode:
            image.verify()  # the file's structure (and PNG's checksums) without decoding every pixel
            return image
        image.load()
    except Exception as err:  # truncated or corrupt data: PIL raises OSError, SyntaxError, ValueError...
        raise ImageProblem(f"{shown}: the image data is damaged ({type(err).__name__}: {err}); replace the "
                           f"file") from None
    return image.convert("RGB") if image.mode != "RGB" else image


def check_images(refs: list[str], where: str, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
    """The up-front check of one record's images (headers only; the run decodes them): DataError naming
    ``where``, the image and the fix."""
    for k, ref in enumerate(refs):
        try:
            open_image(ref, max_pixels=max_pixels, decode=False)
        except ImageProblem as problem:
            raise DataError(where, f"image {k}: {problem.reason}") from None


def load_images(refs: list[str], where: str, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> list[Any]:
    """One record's images, decoded (RGB); DataError as `check_images`."""
    images = []
    for k, ref in enumerate(refs):
        try:
            images.append(open_image(ref, max_pixels=max_pixels))
        except ImageProblem as problem:
            raise DataError(where, f"image {k}: {problem.reason}") from None
    return images
