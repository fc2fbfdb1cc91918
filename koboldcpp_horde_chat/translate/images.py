"""Images of chat jobs made checked data URLs (pure; seed 000 "5. Serve images",
seed 004). koboldcpp reads only data URLs and silently drops an image it cannot
decode, so each image, fetched (:func:`plan_images`) or inline, becomes a data URL
of its sniffed type after a structure check (:func:`finish_images`), or the job is
faulted. JPEG and PNG (stb_image decodes both) are accepted; errors never quote a
URL or image bytes.
"""

from __future__ import annotations

import binascii
import copy
import logging
import re
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ..errors import FetchError
from ..settings import MIB

log = logging.getLogger("koboldcpp_horde_chat.images")


#: Seed 004 states no value: a stored JPEG (quality 90, at most 2048 px) stays under
#: about 8 MiB even for noise, so this refuses none.
MAX_IMAGE_BYTES: Final = 10 * MIB
#: Seed 004: the 36 MiB body cap (seed 000) fits every image as base64: 36 x 3/4.
MAX_REQUEST_IMAGE_BYTES: Final = 27 * MIB
#: koboldcpp keeps only a request's last 16 images (``images_max``): a warning, not a cap.
MAX_IMAGES: Final = 16


class ImageError(FetchError):
    """An image koboldcpp cannot use; as a FetchError the job is faulted without a
    reason. The message names the part (``messages[1].content[0]``) where known."""


JPEG: Final = "image/jpeg"
PNG: Final = "image/png"
ACCEPTED: Final[frozenset[str]] = frozenset({JPEG, PNG})  # what check_decodable passes

# (media type, name, magic number): the common formats, so that a fault names what arrived.
_MAGIC: Final[tuple[tuple[str, str, re.Pattern[bytes]], ...]] = tuple(
    (media_type, name, re.compile(pattern, re.DOTALL))
    for media_type, name, pattern in (
        (JPEG, "JPEG", rb"\xff\xd8\xff"),
        (PNG, "PNG", rb"\x89PNG\r\n\x1a\n"),
        ("image/gif", "GIF", rb"GIF8[79]a"),
        ("image/webp", "WebP", rb"RIFF.{4}WEBP"),
        ("image/bmp", "BMP", rb"BM.{12}[\x0c\x10\x28\x34\x38\x40\x6c\x7c]\x00\x00\x00"),
        ("image/tiff", "TIFF", rb"II\*\x00|MM\x00\*"),
        ("image/vnd.adobe.photoshop", "PSD", rb"8BPS"),
        ("image/vnd.radiance", "Radiance HDR", rb"#\?(?:RADIANCE|RGBE)\n"),
        ("image/x-softimage-pic", "Softimage PIC", rb"\x53\x80\xf6\x34.{84}PICT"),
        ("image/x-portable-bitmap", "PBM", rb"P[14]\s"),
        ("image/x-portable-graymap", "PGM", rb"P[25]\s"),
        ("image/x-portable-pixmap", "PPM", rb"P[36]\s"),
        ("image/avif", "AVIF", rb".{4}ftypavi[fs]"),
        ("image/heic", "HEIC", rb".{4}ftyphe(?:i[cxms]|v[cx])"),
        ("image/heif", "HEIF", rb".{4}ftypm[is]f1"),
        ("image/jxl", "JPEG XL", rb"\xff\x0a|\x00\x00\x00\x0cJXL \r\n\x87\n"),
        ("image/jp2", "JPEG 2000", rb"\x00\x00\x00\x0cjP  \r\n\x87\n"),
        ("image/svg+xml", "SVG", rb"(?i)[\xef\xbb\xbf \t\r\n]*<(?:svg|\?xml.*<svg)"),
    )
)

_NAMES: Final = {media_type: name for media_type, name, _ in _MAGIC} | {"image/x-tga": "TGA"}


def sniff_media_type(data: bytes) -> str | None:
    """The media type from the magic number (seed step 5: from the bytes, never a
    label), or None."""
    head = data[:1024]
    for media_type, _name, magic in _MAGIC:
        if magic.match(head):
            return media_type
    if data[-18:] == b"TRUEVISION-XFILE.\x00":  # TGA has a footer, no magic number
        return "image/x-tga"
    return None


def _unreadable(what: str) -> ImageError:
    return ImageError(f"{what} is not readable by koboldcpp")


_JPEG_UNREADABLE: Final[Mapping[int, str]] = {
    0xC3: "lossless JPEG",
    **dict.fromkeys((0xC5, 0xC6, 0xC7), "hierarchical JPEG"),
    **dict.fromkeys(range(0xC9, 0xD0), "arithmetic-coded JPEG"),
}
# 0xFF ending entropy-coded data: not a stuffed 0x00, a restart marker or fill.
_JPEG_MARKER_IN_SCAN: Final = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")


def _check_jpeg(data: bytes) -> tuple[int, int]:
    """Walk a JPEG's segments from SOI to EOI; returns (width, height). The Horde
    stores what an encoder writes (seed 004), so a cut file, a coding stb_image lacks
    and a missing frame or scan are refused; header fields are not checked further."""
    n, pos = len(data), 2
    size: tuple[int, int] | None = None
    scans = 0
    while True:
        if pos < n and data[pos] != 0xFF:
            raise ImageError(f"corrupt JPEG: no marker at byte {pos}")
        while pos < n and data[pos] == 0xFF:
            pos += 1
        if pos >= n:
            raise ImageError("truncated JPEG")
        marker = data[pos]
        pos += 1
        if marker == 0xD9:  # EOI
            break
        if marker in _JPEG_UNREADABLE:
            raise _unreadable(_JPEG_UNREADABLE[marker])
        length = int.from_bytes(data[pos : pos + 2], "big")
        if pos + max(length, 2) > n:
            raise ImageError("truncated JPEG")
        body, pos = data[pos + 2 : pos + length], pos + length
        if marker in (0xC0, 0xC1, 0xC2):  # SOF: precision, height, width
            if len(body) < 6:
                raise ImageError("corrupt JPEG: frame header")
            precision, height, width = struct.unpack_from(">BHH", body)
            if precision != 8:
                raise _unreadable(f"{precision}-bit JPEG")
            if height == 0:
                raise _unreadable("JPEG whose height is given after the scan (DNL)")
            if width == 0:
                raise ImageError("corrupt JPEG: frame header")
            size = (width, height)
        elif marker == 0xDA:  # SOS, then the entropy-coded data up to the next marker
            if size is None:
                raise ImageError("corrupt JPEG: scan before the frame header")
            scans += 1
            match = _JPEG_MARKER_IN_SCAN.search(data, pos)
            if match is None:
                raise ImageError("truncated JPEG")
            pos = match.start()
    if size is None or not scans:
        raise ImageError("corrupt JPEG: no image data")
    return size


def _check_png(data: bytes) -> tuple[int, int]:
    """Walk a PNG's chunks from IHDR to IEND; returns (width, height). CRCs are not
    checked."""
    n, pos = len(data), 8
    size: tuple[int, int] | None = None
    color, palette = 0, False
    while True:
        if pos + 8 > n:
            raise ImageError("truncated PNG")
        length, ctype = struct.unpack_from(">I4s", data, pos)
        if not ctype.isalpha():
            raise ImageError(f"corrupt PNG: chunk header at byte {pos}")
        body, pos = pos + 8, pos + 12 + length
        if pos > n:
            raise ImageError("truncated PNG")
        if ctype == b"IHDR":
            if size is not None or length != 13:
                raise ImageError("corrupt PNG: IHDR chunk")
            width, height, _depth, color = struct.unpack_from(">IIBB", data, body)
            if not width or not height:
                raise ImageError("corrupt PNG: no pixels")
            size = (width, height)
        elif size is None:
            raise ImageError("corrupt PNG: the first chunk is not IHDR")
        elif ctype == b"PLTE":
            palette = True
        elif ctype == b"IDAT":
            if color == 3 and not palette:
                raise ImageError("corrupt PNG: palette image without PLTE")
        elif ctype == b"IEND":
            return size
        elif not ctype[0] & 0x20:
            raise _unreadable(f"PNG with the unknown critical chunk {ctype.decode('ascii')}")


def check_decodable(data: bytes) -> str:
    """``"image/jpeg"`` or ``"image/png"`` for bytes koboldcpp can read (an 8-bit
    Huffman JPEG or a PNG; pixels and checksums not checked). Raises ImageError naming
    the problem (``"GIF image, not JPEG or PNG"``, ``"truncated JPEG"``)."""
    if not data:
        raise ImageError("empty image")
    media_type = sniff_media_type(data)
    if media_type is None:
        raise ImageError(f"unknown image format (first bytes {data[:8].hex(' ')})")
    if media_type not in ACCEPTED:
        raise ImageError(f"{_NAMES[media_type]} image, not JPEG or PNG")
    width, height = _check_jpeg(data) if media_type == JPEG else _check_png(data)
    # stb_image's STBI_MAX_DIMENSIONS, and its RGBA buffer must fit a signed int
    if max(width, height) > 1 << 24 or width * height * 4 > (1 << 31) - 1:
        raise _unreadable(f"image of {width}x{height} pixels (too large)")
    return media_type


_MEDIA_TYPE: Final = re.compile(r"[a-z0-9][a-z0-9!#$&^_.+-]*/[a-z0-9][a-z0-9!#$&^_.+-]*")
_BASE64: Final = re.compile(r"[A-Za-z0-9+/]*={0,2}")


def _a2b_base64_strict(data: str | bytes) -> bytes:
    """Strict base64; by hand on Python 3.10. Raises binascii.Error."""
    if sys.version_info >= (3, 11):
        return binascii.a2b_base64(data, strict_mode=True)
    text = data if isinstance(data, str) else data.decode("latin-1")
    if len(text) % 4 or not _BASE64.fullmatch(text):
        raise binascii.Error("Only base64 data is allowed")
    return binascii.a2b_base64(data)


def _parse_data_url(url: str) -> tuple[bytes, str | None]:
    """A base64 ``data:`` URL's bytes, and its media type when the URL is already what
    :func:`to_data_url` writes. Whitespace in the base64 is removed. Raises ImageError."""
    if url[:5].lower() != "data:":
        raise ImageError("not a data: URL")
    comma = url.find(",", 5)
    if comma < 0:
        raise ImageError("malformed data: URL (no comma)")
    params = [p.strip() for p in url[5:comma].split(";")]
    media_type = params[0].lower()
    if not params[1:] or params[-1].lower() != "base64":
        raise ImageError("data: URL without ;base64 (koboldcpp reads only base64)")
    if media_type and not _MEDIA_TYPE.fullmatch(media_type):
        raise ImageError("malformed data: URL (media type)")
    payload = url[comma + 1 :]
    try:
        data, clean = _a2b_base64_strict(payload), True  # most URLs: decoded without a copy
    except ValueError:  # whitespace, a non-ASCII character, invalid base64
        try:
            text = payload.encode("ascii").translate(None, b" \t\r\n\f\v")
        except UnicodeEncodeError:
            raise ImageError("invalid base64 in data: URL (non-ASCII character)") from None
        try:
            data, clean = _a2b_base64_strict(text), False
        except binascii.Error as exc:
            raise ImageError(f"invalid base64 in data: URL ({exc})") from None
    if not data:
        raise ImageError("empty image in data: URL")
    return data, media_type if clean and url.startswith(f"data:{media_type};base64,") else None


def to_data_url(media_type: str, data: bytes) -> str:
    return f"data:{media_type};base64,{binascii.b2a_base64(data, newline=False).decode('ascii')}"


def _where(i: int, j: int) -> str:
    return f"messages[{i}].content[{j}]"


def image_urls(messages: Sequence[Any]) -> list[tuple[int, int, str]]:
    """``[(message index, part index, url)]`` of every image_url part with a string
    url; other shapes are ``horde.pop``'s business."""
    found: list[tuple[int, int, str]] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, Mapping) or part.get("type") != "image_url":
                continue
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, Mapping) else None
            if isinstance(url, str):
                found.append((i, j, url))
    return found


def _check_caps(images: Mapping[tuple[int, int], bytes]) -> None:
    """Seed 004's byte caps on one job's images ``{(i, j): bytes}``."""
    for (i, j), data in images.items():
        if len(data) > MAX_IMAGE_BYTES:
            raise ImageError(f"{_where(i, j)}: image of {len(data)} bytes is over the cap of "
                             f"{MAX_IMAGE_BYTES} bytes")
    total = sum(map(len, images.values()))
    if total > MAX_REQUEST_IMAGE_BYTES:
        raise ImageError(f"{len(images)} images of {total} bytes together are over the cap of "
                         f"{MAX_REQUEST_IMAGE_BYTES} bytes per job")


@dataclass(frozen=True)
class ImagePlan:
    """A job's images by transport, keyed ``(i, j)``: URLs to fetch, inline bytes, and
    the declared type of data URLs already canonical (kept as they are if it matches)."""

    to_fetch: list[tuple[int, int, str]] = field(default_factory=list)
    inline: dict[tuple[int, int], bytes] = field(default_factory=dict)
    canonical: dict[tuple[int, int], str] = field(default_factory=dict)


def plan_images(messages: Sequence[Any]) -> ImagePlan:
    """Sort a job's images into URLs to fetch and decoded data URLs, inline ones checked
    against the caps. Raises ImageError for a malformed data URL, another scheme, or a cap.
    """
    plan = ImagePlan()
    for i, j, url in image_urls(messages):
        scheme = url.split(":", 1)[0].strip().lower() if ":" in url else ""
        if scheme == "data":
            try:
                plan.inline[(i, j)], label = _parse_data_url(url)
            except ImageError as exc:
                raise ImageError(f"{_where(i, j)}: {exc}") from None
            if label is not None:
                plan.canonical[(i, j)] = label
        elif scheme in ("http", "https"):
            plan.to_fetch.append((i, j, url))
        else:
            shown = scheme[:20] if scheme else "none"
            raise ImageError(f"{_where(i, j)}: image URL scheme {shown!r} is not served")
    _check_caps(plan.inline)
    return plan


def finish_images(messages: Sequence[Any], plan: ImagePlan,
                  fetched: Mapping[tuple[int, int], bytes]) -> list[dict[str, Any]]:
    """A deep copy of ``messages`` with every image a checked data URL of its sniffed
    type (a canonical one kept); ``fetched`` holds every ``plan.to_fetch``. Raises
    ImageError, or ValueError when the plan or ``fetched`` does not match (a bug)."""
    wanted = {(i, j) for i, j, _ in plan.to_fetch}
    parts = {(i, j) for i, j, _ in image_urls(messages)}
    if parts != wanted | set(plan.inline) or not set(fetched) <= wanted:
        raise ValueError("the plan or the fetched images do not match the messages")
    images: dict[tuple[int, int], bytes] = dict(plan.inline)
    for i, j, _url in plan.to_fetch:
        data = fetched.get((i, j))
        if data is None:
            raise ImageError(f"{_where(i, j)}: image was not fetched")
        images[(i, j)] = bytes(data)
    images = dict(sorted(images.items()))
    _check_caps(images)
    result: list[dict[str, Any]] = copy.deepcopy(list(messages))
    for (i, j), data in images.items():
        try:
            media_type = check_decodable(data)
        except ImageError as exc:
            raise ImageError(f"{_where(i, j)}: {exc}") from None
        if plan.canonical.get((i, j)) != media_type:  # else the string is kept
            result[i]["content"][j]["image_url"]["url"] = to_data_url(media_type, data)
    if len(images) > MAX_IMAGES:
        log.warning("job holds %d images; koboldcpp keeps only the last %d and answers "
                    "without the first %d", len(images), MAX_IMAGES, len(images) - MAX_IMAGES)
    if images:
        log.debug("%d images checked, %d bytes", len(images), sum(map(len, images.values())))
    return result
