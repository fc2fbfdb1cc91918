"""Images of chat jobs: media type from the bytes, JPEG/PNG checks, data URLs, caps (pure; no I/O).

Seed sections: "5. Serve images" and "7. Fault a job" (seed 000), and seed 004
("Send chat images to workers by the transport each worker declares").

The Horde stores every image as JPEG at quality 90 and sends each worker that JPEG
as a signed URL or a ``data:image/jpeg;base64,`` URL, also inside offloaded messages
(seed 004). koboldcpp reads only ``data:image`` URLs and silently drops an image it
cannot decode, so every image becomes a checked data URL or the job is faulted::

    plan = images.plan_images(messages)            # data: URLs decoded, http(s) URLs listed
    fetched = {(i, j): fetch.fetch_image(url, timeout_s=..., max_bytes=images.MAX_IMAGE_BYTES)
               for i, j, url in plan.to_fetch}     # the ``url`` transport, bounded fetches
    messages = images.finish_images(messages, plan, fetched)   # every image checked

JPEG and PNG (koboldcpp's loader, stb_image, decodes both) are accepted; any other
type is faulted by its sniffed name. Errors never quote a URL or image bytes.
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


MAX_IMAGE_BYTES: Final = 10 * MIB
"""Cap on one image's bytes (seed 004 states no value): a stored JPEG (quality 90, longest
side at most 2048 px) stays under about 8 MiB even for noise, so this refuses none."""

MAX_REQUEST_IMAGE_BYTES: Final = 27 * MIB
"""Cap on one job's image bytes. Seed 004: "The body cap fits a request at every cap as
base64 data URLs"; the body cap is 36 MiB (seed 000), as base64 36 x 3/4 = 27 MiB."""

MAX_IMAGES: Final = 16
"""koboldcpp keeps only the last 16 images of a request (``images_max``); not a cap, since
the Horde decides how many a request holds: :func:`finish_images` logs a warning."""


class ImageError(FetchError):
    """An image koboldcpp cannot use (not JPEG or PNG, malformed, truncated, over a cap): as a
    FetchError, the job is faulted without ``fault_reason`` (seed 000 step 7). The message
    names the image's place (``messages[1].content[0]``) where known."""


# --- sniffing -------------------------------------------------------------------------

JPEG: Final = "image/jpeg"
PNG: Final = "image/png"
ACCEPTED: Final[frozenset[str]] = frozenset({JPEG, PNG})  # what check_decodable passes

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
"""(media type, name, magic number): the common formats, so that a fault names what arrived."""

_NAMES: Final = {media_type: name for media_type, name, _ in _MAGIC} | {"image/x-tga": "TGA"}


def sniff_media_type(data: bytes) -> str | None:
    """The media type of image bytes (any length) from their magic number, or None.

    Seed 000 step 5: "take the media type from the bytes", never from a
    ``Content-Type`` or a data URL's label. Returns ``"image/jpeg"``,
    ``"image/png"`` or another type of ``_MAGIC`` (``"image/gif"``...) or ``"image/x-tga"``.
    """
    head = bytes(data[:1024])
    for media_type, _name, magic in _MAGIC:
        if magic.match(head):
            return media_type
    if bytes(data[-18:]) == b"TRUEVISION-XFILE.\x00":  # TGA has a footer, no magic number
        return "image/x-tga"
    return None


# --- JPEG and PNG structure, as stb_image (koboldcpp's loader) reads it -------------------


def _unreadable(what: str) -> ImageError:
    return ImageError(f"{what} is not readable by koboldcpp")


_JPEG_UNREADABLE: Final[Mapping[int, str]] = {
    0xC3: "lossless JPEG",
    **dict.fromkeys((0xC5, 0xC6, 0xC7), "hierarchical JPEG"),
    **dict.fromkeys(range(0xC9, 0xD0), "arithmetic-coded JPEG"),
}
# SOF0..2 (baseline, extended, progressive Huffman), DHT, SOS, DQT, DNL, DRI, COM (and APPn).
_JPEG_SEGMENTS: Final = frozenset({0xC0, 0xC1, 0xC2, 0xC4, 0xDA, 0xDB, 0xDC, 0xDD, 0xFE})
# 0xFF ending entropy-coded data: not a stuffed 0x00, a restart marker or fill.
_JPEG_MARKER_IN_SCAN: Final = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")


def _check_jpeg(data: bytes) -> tuple[int, int]:
    """Walks a JPEG's segments from SOI to EOI, checking frame and scan headers as stb_image
    does; returns (width, height). Stray bytes between segments are skipped before the
    frame header, as stb_image skips them; after it they end decoding early: refused."""
    n, pos = len(data), 2
    width = height = scans = 0
    ids: frozenset[int] | None = None  # the frame's component ids, once it is read
    progressive = False
    while True:
        if pos < n and data[pos] != 0xFF:
            if ids is not None:
                raise ImageError(f"corrupt JPEG: no marker at byte {pos}")
            pos = data.find(b"\xff", pos) % (n + 1)  # none found: n, truncated below
        while pos < n and data[pos] == 0xFF:
            pos += 1
        if pos >= n:
            raise ImageError("truncated JPEG")
        marker = data[pos]
        pos += 1
        if marker == 0xD9:  # EOI
            break
        if 0xD0 <= marker <= 0xD7 and scans:  # a restart marker after a scan
            continue
        if marker in _JPEG_UNREADABLE:
            raise _unreadable(_JPEG_UNREADABLE[marker])
        if marker not in _JPEG_SEGMENTS and marker >> 4 != 0xE:
            raise ImageError(f"corrupt JPEG: unexpected marker FF{marker:02X}")
        if pos + 2 > n:
            raise ImageError("truncated JPEG")
        length = int.from_bytes(data[pos : pos + 2], "big")
        if length < 2:
            raise ImageError("corrupt JPEG: segment length")
        body, pos = data[pos + 2 : pos + length], pos + length
        if pos > n:
            raise ImageError("truncated JPEG")
        if marker in (0xC0, 0xC1, 0xC2):  # SOF: precision, height, width, components
            if ids is not None:
                raise ImageError("corrupt JPEG: second frame header")
            if len(body) < 6:
                raise ImageError("corrupt JPEG: frame header")
            precision, height, width, count = struct.unpack_from(">BHHB", body)
            if precision != 8:
                raise _unreadable(f"{precision}-bit JPEG")
            if height == 0:
                raise _unreadable("JPEG whose height is given after the scan (DNL)")
            comps = [body[k : k + 3] for k in range(6, len(body), 3)]  # (id, sampling, table)
            if width == 0 or count not in (1, 3, 4) or len(body) != 6 + 3 * count or any(
                not (1 <= s >> 4 <= 4 and 1 <= s & 15 <= 4) or t > 3 for _, s, t in comps
            ):
                raise ImageError("corrupt JPEG: frame header")
            ids, progressive = frozenset(c[0] for c in comps), marker == 0xC2
        elif marker == 0xDA:  # SOS: components, then (id, tables) each, then start, end, approx
            if ids is None:
                raise ImageError("corrupt JPEG: scan before the frame header")
            count = body[0] if body else 0
            if not 1 <= count <= min(4, len(ids)) or len(body) != 4 + 2 * count:
                raise ImageError("corrupt JPEG: scan header")
            start, end, approx = body[-3:]
            if progressive:
                bad = start > end or end > 63 or approx >> 4 > 13 or approx & 15 > 13
            else:
                bad = start != 0 or approx != 0
            pairs = zip(body[1:-3:2], body[2:-3:2], strict=True)
            if bad or any(c not in ids or t >> 4 > 3 or t & 15 > 3 for c, t in pairs):
                raise ImageError("corrupt JPEG: scan header")
            scans += 1
            match = _JPEG_MARKER_IN_SCAN.search(data, pos)
            if match is None:
                raise ImageError("truncated JPEG")
            pos = match.start()
    if not scans:
        raise ImageError("corrupt JPEG: no image data")
    return width, height


def _check_png(data: bytes) -> tuple[int, int]:
    """Walks a PNG's chunks from IHDR to IEND as stb_image reads them; returns (width,
    height). Apple's ``CgBI`` may come before IHDR; CRCs are not checked."""
    n, pos = len(data), 8
    size: tuple[int, int] | None = None
    color, palette, idat = 0, False, False
    while True:
        if pos + 8 > n:
            raise ImageError("truncated PNG")
        length, ctype = struct.unpack_from(">I4s", data, pos)
        if length > 0x7FFFFFFF or not ctype.isalpha():
            raise ImageError(f"corrupt PNG: chunk header at byte {pos}")
        body, pos = pos + 8, pos + 12 + length
        if pos > n:
            raise ImageError("truncated PNG")
        if ctype == b"CgBI":
            continue
        if ctype == b"IHDR":
            if size is not None or length != 13:
                raise ImageError("corrupt PNG: IHDR chunk")
            width, height, depth, color, *methods, interlace = struct.unpack_from(
                ">IIBBBBB", data, body
            )
            bad_color = color > 6 or (color & 1 and color != 3) or (color == 3 and depth == 16)
            if depth not in (1, 2, 4, 8, 16) or bad_color or any(methods) or interlace > 1:
                raise ImageError("corrupt PNG: IHDR chunk")
            if not width or not height:
                raise ImageError("corrupt PNG: no pixels")
            channels = 4 if color == 3 else (3 if color & 2 else 1) + (1 if color & 4 else 0)
            if (1 << 30) // width // channels < height:
                raise _unreadable(f"PNG of {width}x{height} pixels (too large)")
            size = (width, height)
        elif size is None:
            raise ImageError("corrupt PNG: the first chunk is not IHDR")
        elif ctype == b"PLTE":
            if length > 768 or length % 3:
                raise ImageError("corrupt PNG: PLTE length")
            palette = True
        elif ctype == b"IDAT":
            if color == 3 and not palette:
                raise ImageError("corrupt PNG: palette image without PLTE")
            idat = True
        elif ctype == b"IEND":
            if not idat:
                raise ImageError("corrupt PNG: no IDAT chunk")
            return size
        elif not ctype[0] & 0x20:
            raise _unreadable(f"PNG with the unknown critical chunk {ctype.decode('ascii')}")


def check_decodable(data: bytes) -> str:
    """``"image/jpeg"`` or ``"image/png"`` for image bytes koboldcpp can read (seed 004).

    The type is sniffed (:func:`sniff_media_type`) and the structure walked as
    stb_image reads it: a JPEG from SOI to EOI with a baseline, extended or
    progressive Huffman frame of 8-bit samples; a PNG from IHDR through IDAT to
    IEND. Bytes after the end (zero padding) are ignored; pixels and checksums are
    not checked (stb_image does not verify checksums either).

    Raises:
        ImageError: ``"empty image"``; ``"unknown image format (first bytes ...)"``;
            another type by name (``"GIF image, not JPEG or PNG"``); ``"truncated
            JPEG"`` (or ``PNG``); ``"corrupt JPEG: ..."``; a variant or size stb_image
            refuses (``"12-bit JPEG is not readable by koboldcpp"``).
    """
    if not data:
        raise ImageError("empty image")
    data = bytes(data)
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


# --- data URLs ----------------------------------------------------------------------------

_MEDIA_TYPE: Final = re.compile(r"[a-z0-9][a-z0-9!#$&^_.+-]*/[a-z0-9][a-z0-9!#$&^_.+-]*")
_BASE64: Final = re.compile(r"[A-Za-z0-9+/]*={0,2}")


def _a2b_base64_strict(data: str | bytes) -> bytes:
    """``a2b_base64(data, strict_mode=True)``; by hand on Python 3.10. Raises binascii.Error."""
    if sys.version_info >= (3, 11):
        return binascii.a2b_base64(data, strict_mode=True)
    text = data if isinstance(data, str) else data.decode("latin-1")
    if len(text) % 4 or not _BASE64.fullmatch(text):
        raise binascii.Error("Only base64 data is allowed")
    return binascii.a2b_base64(data)


def _parse_data_url(url: str) -> tuple[bytes, str | None]:
    """A base64 ``data:`` URL's bytes, and its declared media type (lower case) when ``url``
    is already what :func:`to_data_url` writes for that type. Case-insensitive; parameters
    before ``;base64`` are ignored and whitespace in the base64 removed, the rest is decoded
    strictly. Raises ImageError, never quoting the URL."""
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
    """``"data:<media_type>;base64,<base64, padded, no line breaks>"``, as koboldcpp reads it."""
    return f"data:{media_type};base64,{binascii.b2a_base64(data, newline=False).decode('ascii')}"


# --- image parts in messages ---------------------------------------------------------------


def _where(i: int, j: int) -> str:
    return f"messages[{i}].content[{j}]"


def image_urls(messages: Sequence[Any]) -> list[tuple[int, int, str]]:
    """Every ``{"type": "image_url", "image_url": {"url": str}}`` part of the messages'
    ``content`` lists, in order, as ``[(message index, part index, url)]``; other shapes
    are skipped (they are ``horde.pop.validate_messages``'s business)."""
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
    """Seed 004's caps on one job's images ``{(i, j): bytes}``; their number is not capped."""
    for (i, j), data in images.items():
        if len(data) > MAX_IMAGE_BYTES:
            raise ImageError(
                f"{_where(i, j)}: image of {len(data)} bytes is over the cap of "
                f"{MAX_IMAGE_BYTES} bytes"
            )
    total = sum(map(len, images.values()))
    if total > MAX_REQUEST_IMAGE_BYTES:
        raise ImageError(
            f"{len(images)} images of {total} bytes together are over the cap of "
            f"{MAX_REQUEST_IMAGE_BYTES} bytes per job"
        )


@dataclass(frozen=True)
class ImagePlan:
    """A job's images sorted by transport (from :func:`plan_images`); keys are ``(i, j)``.

    Attributes:
        to_fetch: ``[(i, j, url)]``, every http(s) URL (the ``url`` transport).
        inline: ``{(i, j): bytes}`` decoded from every ``data:`` URL.
        canonical: ``{(i, j): declared media type}`` of the data URLs already as
            :func:`to_data_url` writes them; one of its sniffed type is passed on as is.
    """

    to_fetch: list[tuple[int, int, str]] = field(default_factory=list)
    inline: dict[tuple[int, int], bytes] = field(default_factory=dict)
    canonical: dict[tuple[int, int], str] = field(default_factory=dict)


def plan_images(messages: Sequence[Any]) -> ImagePlan:
    """Sorts a job's image parts into URLs to fetch and inline data URLs (decoded here).

    Seed 000 step 5, seed 004: an image arrives as a signed http(s) URL (``url``)
    or a ``data:image/jpeg;base64,`` URL (``base64`` and offloaded messages).
    Inline images are checked against the caps before any fetch, formats by
    :func:`finish_images`. A job without images gives ``ImagePlan()``.

    Raises:
        ImageError: a malformed data URL or invalid base64, a scheme other than
            ``data``, ``http`` and ``https``, or inline images over a cap; the
            message names the part (``messages[1].content[0]: ...``).
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


def finish_images(
    messages: Sequence[Any],
    plan: ImagePlan,
    fetched: Mapping[tuple[int, int], bytes],
) -> list[dict[str, Any]]:
    """A deep copy of ``messages`` with every image a checked ``data:`` URL of its sniffed type.

    ``fetched`` holds ``{(i, j): bytes}`` for every entry of ``plan.to_fetch``. All
    images are checked together against the caps (seed 004), then each with
    :func:`check_decodable`, and each url becomes ``to_data_url(sniffed type,
    bytes)`` (a PNG labelled ``image/jpeg`` becomes ``data:image/png;base64,...``)
    unless ``plan.canonical`` shows it is that already: then the string is kept.
    Other keys of a part (``detail``) are kept. More than :data:`MAX_IMAGES`
    images are let through with a warning.

    Raises:
        ImageError: an image not fetched, over the caps, or not a JPEG or PNG
            koboldcpp can read; the message names the part
            (``"messages[0].content[1]: GIF image, not JPEG or PNG"``).
        ValueError: ``plan`` or ``fetched`` does not match ``messages`` (a caller's bug).
    """
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
