"""Images of chat jobs: media type from the bytes, JPEG/PNG checks, data URLs, caps (pure; no I/O).

Seed sections: "5. Serve images" and "7. Fault a job" (seed 000), and seed 004
("Send chat images to workers by the transport each worker declares").

What can arrive: at submit the Horde normalises every image and stores it as
JPEG at quality 90 (seed 004), then sends each worker that JPEG as a signed URL
or a ``data:image/jpeg;base64,`` URL; offloaded messages carry the same data
URLs (seed 000 step 5). So this module accepts JPEG, and PNG as a second format
(koboldcpp's image loader decodes both), and walks their structure far enough
to catch what really happens to bytes in transit (truncation) and the variants
the loader refuses. Any other type is faulted by the name of its sniffed type
(``"GIF image, not JPEG or PNG"``): a conforming Horde never sends one.

koboldcpp reads an image only from an ``image_url`` part whose url starts with
``data:image``, and silently drops an http(s) URL or bytes it cannot decode. So
the worker turns every image into a ``data:`` URL whose bytes were checked here,
and faults the job (without ``fault_reason``, step 7) when it cannot::

    plan = images.plan_images(messages)            # data: URLs decoded, http(s) URLs listed
    fetched = {(i, j): fetch.fetch_image(url, timeout_s=..., max_bytes=images.MAX_IMAGE_BYTES)
               for i, j, url in plan.to_fetch}     # the ``url`` transport, bounded fetches
    messages = images.finish_images(messages, plan, fetched)   # every image checked

:class:`ImageError` (a :class:`~koboldcpp_horde_chat.errors.FetchError`) is the
only error raised for bad input; messages never contain a URL or image bytes.
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

from .errors import FetchError

log = logging.getLogger(__name__)

MIB: Final = 1024 * 1024

MAX_IMAGE_BYTES: Final = 10 * MIB
"""Cap on one image's bytes (10 MiB; seed 004's per-image cap, value not stated).

A stored image is a JPEG at quality 90, longest side at most 2048 px (seed 004):
a few hundred KiB for a photo, under about 8 MiB even for pure noise, so 10 MiB
never refuses one and bounds one download (``max_bytes`` of ``fetch.fetch_image``).
"""

MAX_REQUEST_IMAGE_BYTES: Final = 27 * MIB
"""Cap on the sum of one job's image bytes (27 MiB).

Seed 004: "The body cap fits a request at every cap as base64 data URLs", and the
body cap is 36 MiB (seed 000, "Fetch offloaded messages"); as base64 (4 characters
per 3 bytes) the images are below 36 MiB x 3/4 = 27 MiB.
"""

MAX_IMAGES: Final = 16
"""koboldcpp keeps only the last 16 images of a request (``images_max`` in koboldcpp.py).

Not a cap: the Horde decides how many images a request holds, and seed 000 says
to fault only what the worker cannot serve; :func:`finish_images` logs a warning.
"""

_STB_MAX_DIMENSION: Final = 1 << 24
"""stb_image's ``STBI_MAX_DIMENSIONS``: a larger width or height is refused."""
_STB_MAX_BUFFER: Final = (1 << 31) - 1
"""stb_image refuses images whose RGBA buffer would not fit a signed int."""


class ImageError(FetchError):
    """An image cannot be handed to koboldcpp: not JPEG or PNG, malformed, truncated or over a cap.

    A subclass of :class:`~koboldcpp_horde_chat.errors.FetchError`, so the worker
    faults the job without ``fault_reason`` (seed 000 step 7: "an image cannot
    be fetched"; "A fetch that fails is a faulted job"). The message names the
    image's place (``messages[1].content[0]``) where known, never its URL or bytes.
    """


# --- sniffing -------------------------------------------------------------------------

JPEG: Final = "image/jpeg"
PNG: Final = "image/png"

ACCEPTED: Final[frozenset[str]] = frozenset({JPEG, PNG})
"""The media types :func:`check_decodable` passes: JPEG, what the Horde sends
(seed 004), and PNG, the other format seed 004 names koboldcpp's loader as decoding."""

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
    )
)
"""(media type, name, magic number at the start): the common image formats, so a
fault names what arrived. Only JPEG and PNG are accepted."""

_TGA_FOOTER: Final = b"TRUEVISION-XFILE.\x00"
_NAMES: Final[Mapping[str, str]] = {
    **{media_type: name for media_type, name, _ in _MAGIC},
    "image/svg+xml": "SVG",
    "image/x-tga": "TGA",
}


def sniff_media_type(data: bytes) -> str | None:
    """The media type of an image, from its magic number alone.

    Never looks at a ``Content-Type`` header or a data URL's label (seed 000
    step 5: "take the media type from the bytes"; an object store may return a
    generic type).

    Args:
        data: the image bytes (any length, possibly empty or truncated).

    Returns:
        ``"image/jpeg"`` (``FF D8 FF``), ``"image/png"`` (``89 50 4E 47 0D 0A 1A
        0A``), a faulted type of ``_MAGIC`` (``"image/gif"``, ``"image/webp"``...),
        ``"image/svg+xml"``, ``"image/x-tga"`` (by the TGA 2.0 footer at the end:
        TGA has no magic number), or None when nothing matches.
    """
    head = bytes(data[:96])
    for media_type, _name, magic in _MAGIC:
        if magic.match(head):
            return media_type
    text = bytes(data[:1024]).lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if text.startswith(b"<svg") or (text.startswith(b"<?xml") and b"<svg" in text):
        return "image/svg+xml"
    if bytes(data[-len(_TGA_FOOTER) :]) == _TGA_FOOTER:
        return "image/x-tga"
    return None


# --- JPEG and PNG structure -------------------------------------------------------------


def _truncated(fmt: str) -> ImageError:
    return ImageError(f"truncated {fmt}")


def _corrupt(fmt: str, problem: str) -> ImageError:
    return ImageError(f"corrupt {fmt}: {problem}")


def _unreadable(what: str) -> ImageError:
    return ImageError(f"{what} is not readable by koboldcpp")


# JPEG markers (ITU T.81 B.1.1.3).
_SOF_READABLE: Final = frozenset({0xC0, 0xC1, 0xC2})
_SOF_PROGRESSIVE: Final = 0xC2
_JPEG_UNREADABLE: Final[Mapping[int, str]] = {
    0xC3: "lossless JPEG",
    **dict.fromkeys((0xC5, 0xC6, 0xC7), "hierarchical JPEG"),
    **dict.fromkeys(range(0xC9, 0xD0), "arithmetic-coded JPEG"),
}
_JPEG_TABLE_MARKERS: Final = frozenset({0xC4, 0xDB, 0xDC, 0xDD, 0xFE} | set(range(0xE0, 0xF0)))
"""DHT, DQT, DNL, DRI, COM and APP0..APP15: segments stb_image reads or skips."""


def _jpeg_frame(body: bytes) -> tuple[int, int, frozenset[int]]:
    """Checks a SOF segment's body (after the length); returns (width, height, component ids)."""
    if len(body) < 6:
        raise _corrupt("JPEG", "short frame header")
    precision, height, width, count = struct.unpack_from(">BHHB", body)
    if precision != 8:
        raise _unreadable(f"{precision}-bit JPEG")
    if height == 0:
        raise _unreadable("JPEG whose height is given after the scan (DNL)")
    if width == 0:
        raise _corrupt("JPEG", "zero width")
    if count not in (1, 3, 4):
        raise _corrupt("JPEG", f"{count} components")
    if len(body) != 6 + 3 * count:
        raise _corrupt("JPEG", "frame header length")
    ids = set()
    for k in range(count):
        comp_id, sampling, table = body[6 + 3 * k : 9 + 3 * k]
        if not (1 <= sampling >> 4 <= 4 and 1 <= sampling & 15 <= 4) or table > 3:
            raise _corrupt("JPEG", "component parameters")
        ids.add(comp_id)
    return width, height, frozenset(ids)


def _jpeg_scan(body: bytes, ids: frozenset[int], progressive: bool) -> None:
    """Checks a SOS segment's body (after the length) as stb_image does."""
    if not body:
        raise _corrupt("JPEG", "empty scan header")
    count = body[0]
    if not 1 <= count <= min(4, len(ids)) or len(body) != 4 + 2 * count:
        raise _corrupt("JPEG", "scan header")
    for k in range(count):
        comp_id, tables = body[1 + 2 * k], body[2 + 2 * k]
        if comp_id not in ids or tables >> 4 > 3 or tables & 15 > 3:
            raise _corrupt("JPEG", "scan component")
    start, end, approx = body[1 + 2 * count :]
    if progressive:
        if start > end or end > 63 or approx >> 4 > 13 or approx & 15 > 13:
            raise _corrupt("JPEG", "progressive scan parameters")
    elif start != 0 or approx != 0:
        raise _corrupt("JPEG", "sequential scan parameters")


_JPEG_MARKER_IN_SCAN: Final = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
"""A marker ending entropy-coded data: 0xFF followed by neither a stuffed 0x00, a
restart marker (RST0..RST7) nor another 0xFF (fill)."""


def _jpeg_skip_entropy(data: bytes, pos: int) -> int:
    """Skips entropy-coded data from ``pos``; returns the offset of the next marker's 0xFF."""
    match = _JPEG_MARKER_IN_SCAN.search(data, pos)
    if match is None:
        raise _truncated("JPEG")
    return match.start()


def _check_jpeg(data: bytes) -> tuple[int, int]:
    """Walks a JPEG's segments from SOI to EOI; returns (width, height).

    The frame must be baseline, extended or progressive Huffman with 8-bit
    samples (stb_image's ``stbi__SOF``), come before the first scan, and be
    followed by at least one scan and the EOI marker. Bytes after EOI are
    ignored (stb_image stops there), so trailing zero padding is accepted.
    Before the frame header stb_image skips stray bytes between segments; after
    it, a stray byte ends stb_image's decoding early, so it is refused here.
    """
    n = len(data)
    pos = 2
    frame: tuple[int, int, frozenset[int]] | None = None
    progressive = False
    scans = 0
    while True:
        if pos >= n:
            raise _truncated("JPEG")
        if data[pos] != 0xFF:
            if frame is not None:
                raise _corrupt("JPEG", f"no marker at byte {pos}")
            pos = data.find(b"\xff", pos)
            if pos < 0:
                raise _truncated("JPEG")
        while pos < n and data[pos] == 0xFF:
            pos += 1
        if pos >= n:
            raise _truncated("JPEG")
        marker = data[pos]
        pos += 1
        if marker == 0xD9:  # EOI
            break
        if 0xD0 <= marker <= 0xD7 and scans:  # a restart marker right after a scan
            continue
        if marker in _JPEG_UNREADABLE:
            raise _unreadable(_JPEG_UNREADABLE[marker])
        if marker not in _SOF_READABLE and marker != 0xDA and marker not in _JPEG_TABLE_MARKERS:
            raise _corrupt("JPEG", f"unexpected marker FF{marker:02X}")
        if pos + 2 > n:
            raise _truncated("JPEG")
        (length,) = struct.unpack_from(">H", data, pos)
        if length < 2:
            raise _corrupt("JPEG", "segment length")
        end = pos + length
        if end > n:
            raise _truncated("JPEG")
        if marker in _SOF_READABLE:
            if frame is not None:
                raise _corrupt("JPEG", "second frame header")
            frame = _jpeg_frame(data[pos + 2 : end])
            progressive = marker == _SOF_PROGRESSIVE
        elif marker == 0xDA:
            if frame is None:
                raise _corrupt("JPEG", "scan before the frame header")
            _jpeg_scan(data[pos + 2 : end], frame[2], progressive)
            scans += 1
            pos = _jpeg_skip_entropy(data, end)
            continue
        pos = end
    if frame is None:
        raise _corrupt("JPEG", "no frame header")
    if scans == 0:
        raise _corrupt("JPEG", "no image data")
    return frame[0], frame[1]


def _check_png(data: bytes) -> tuple[int, int]:
    """Walks a PNG's chunks from IHDR to IEND; returns (width, height).

    IHDR must come first (after Apple's ``CgBI``, which stb_image also reads),
    with a bit depth and colour type stb_image accepts; a palette image needs
    PLTE before its IDAT; there must be at least one IDAT; an unknown critical
    chunk is refused (stb_image refuses it); the IEND chunk, CRC included, must
    be present. Bytes after IEND are ignored; CRCs are not checked (stb_image
    does not check them).
    """
    n = len(data)
    pos = 8
    size: tuple[int, int] | None = None
    color = 0
    palette = False
    idat = False
    while True:
        if pos + 8 > n:
            raise _truncated("PNG")
        length, ctype = struct.unpack_from(">I4s", data, pos)
        if length > 0x7FFFFFFF or not ctype.isalpha():
            raise _corrupt("PNG", f"chunk header at byte {pos}")
        body = pos + 8
        end = body + length + 4
        if end > n:
            raise _truncated("PNG")
        if ctype == b"CgBI":
            pass
        elif ctype == b"IHDR":
            if size is not None:
                raise _corrupt("PNG", "second IHDR chunk")
            if length != 13:
                raise _corrupt("PNG", "IHDR length")
            width, height, depth, color, method, filtering, interlace = struct.unpack_from(
                ">IIBBBBB", data, body
            )
            if depth not in (1, 2, 4, 8, 16):
                raise _unreadable(f"PNG with {depth}-bit samples")
            if color > 6 or (color & 1 and color != 3) or (color == 3 and depth == 16):
                raise _corrupt("PNG", f"colour type {color} with {depth}-bit samples")
            if method or filtering or interlace > 1:
                raise _corrupt("PNG", "compression, filter or interlace method")
            if width == 0 or height == 0:
                raise _corrupt("PNG", "no pixels")
            channels = 4 if color == 3 else (3 if color & 2 else 1) + (1 if color & 4 else 0)
            if (1 << 30) // width // channels < height:
                raise _unreadable(f"PNG of {width}x{height} pixels (too large)")
            size = (width, height)
        elif size is None:
            raise _corrupt("PNG", "the first chunk is not IHDR")
        elif ctype == b"PLTE":
            if length > 768 or length % 3:
                raise _corrupt("PNG", "PLTE length")
            palette = True
        elif ctype == b"IDAT":
            if color == 3 and not palette:
                raise _corrupt("PNG", "palette image without PLTE")
            idat = True
        elif ctype == b"IEND":
            if not idat:
                raise _corrupt("PNG", "no IDAT chunk")
            break
        elif not ctype[0] & 0x20:
            raise _unreadable(f"PNG with the unknown critical chunk {ctype.decode('ascii')}")
        pos = end
    assert size is not None
    return size


def check_decodable(data: bytes) -> str:
    """The media type of a JPEG or PNG koboldcpp can read; raises for anything else.

    Seed 004: the Horde sends every image as the JPEG it stored, so JPEG is what
    arrives; PNG is accepted as well. The type is sniffed from the magic number
    (:func:`sniff_media_type`), and the file's structure is walked:

    * JPEG: segments from SOI to the EOI marker ``FF D9`` (bytes after it, such
      as zero padding, are ignored); a baseline, extended or progressive Huffman
      frame header (SOF0/1/2) with 8-bit samples before the first scan.
    * PNG: IHDR first, IDAT present, an IEND chunk at the end.

    Pixels are not decoded and checksums not verified (stb_image, koboldcpp's
    loader, does not verify them either).

    Args:
        data: the image bytes (decoded from base64 or fetched).

    Returns:
        ``"image/jpeg"`` or ``"image/png"``.

    Raises:
        ImageError: ``"empty image"``; ``"unknown image format (first bytes
            ...)"``; another type by name, e.g. ``"GIF image, not JPEG or PNG"``;
            ``"truncated JPEG"`` (or ``PNG``); ``"corrupt JPEG: ..."``; a variant
            koboldcpp cannot read (``"12-bit JPEG is not readable by koboldcpp"``)
            or an image larger than it decodes.
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
    if (
        width > _STB_MAX_DIMENSION
        or height > _STB_MAX_DIMENSION
        or width * height * 4 > _STB_MAX_BUFFER
    ):
        raise _unreadable(f"image of {width}x{height} pixels (too large)")
    return media_type


# --- data URLs ----------------------------------------------------------------------------

_WHITESPACE_BYTES: Final = b" \t\r\n\f\v"
_MEDIA_TYPE: Final = re.compile(r"[a-z0-9][a-z0-9!#$&^_.+-]*/[a-z0-9][a-z0-9!#$&^_.+-]*")
_BASE64: Final = re.compile(r"[A-Za-z0-9+/]*={0,2}")


def _a2b_base64_strict(data: str | bytes) -> bytes:
    """``binascii.a2b_base64(data, strict_mode=True)``; on Python 3.10, which has no
    ``strict_mode``, the same check by hand: only the base64 alphabet, padded to a
    multiple of 4, ``=`` only at the end. Raises ``binascii.Error`` (a ValueError)."""
    if sys.version_info >= (3, 11):
        return binascii.a2b_base64(data, strict_mode=True)
    text = data if isinstance(data, str) else data.decode("latin-1")
    if len(text) % 4 or not _BASE64.fullmatch(text):
        raise binascii.Error("Only base64 data is allowed")
    return binascii.a2b_base64(data)


def parse_data_url(url: str) -> tuple[str, bytes]:
    """Splits a base64 ``data:`` URL into its declared media type and its bytes.

    ``"data:image/jpeg;base64,/9j/4AAQ..."`` -> ``("image/jpeg", b"\\xff\\xd8...")``.
    Scheme, media type and ``base64`` are case-insensitive; parameters before
    ``;base64`` are ignored; whitespace in the base64 text is removed and the rest
    decoded strictly. The declared type (lower case, ``""`` when none) is only a
    label: :func:`check_decodable` gives the real one.

    Raises:
        ImageError: not a ``data:`` URL, no comma, no ``;base64`` marker (koboldcpp
            reads only base64), a malformed media type, invalid base64, or no bytes.
            The message never quotes the URL.
    """
    media_type, data, _canonical = _parse_data_url(url)
    return media_type, data


def _parse_data_url(url: str) -> tuple[str, bytes, bool]:
    """:func:`parse_data_url`, plus whether ``url`` is already in the form
    :func:`to_data_url` writes for its declared type: ``data:<type>;base64,`` in
    lower case and base64 without whitespace."""
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
        # Most URLs are clean: decode the string as it is, without a copy.
        data = _a2b_base64_strict(payload)
        clean = True
    except ValueError:  # whitespace, a non-ASCII character, invalid base64
        try:
            text = payload.encode("ascii").translate(None, _WHITESPACE_BYTES)
        except UnicodeEncodeError:
            raise ImageError("invalid base64 in data: URL (non-ASCII character)") from None
        try:
            data = _a2b_base64_strict(text)
        except binascii.Error as exc:
            raise ImageError(f"invalid base64 in data: URL ({exc})") from None
        clean = False
    if not data:
        raise ImageError("empty image in data: URL")
    canonical = clean and url.startswith(f"data:{media_type};base64,")
    return media_type, data, canonical


def to_data_url(media_type: str, data: bytes) -> str:
    """``"data:<media_type>;base64,<standard base64, padded, no line breaks>"``: the
    form koboldcpp reads (a url starting with ``data:image``)."""
    return f"data:{media_type};base64,{binascii.b2a_base64(data, newline=False).decode('ascii')}"


# --- image parts in messages ---------------------------------------------------------------


def _where(i: int, j: int) -> str:
    return f"messages[{i}].content[{j}]"


def image_urls(messages: Sequence[Any]) -> list[tuple[int, int, str]]:
    """Every ``image_url`` part of a conversation, in order: ``[(message index, part index, url)]``.

    An image part is ``{"type": "image_url", "image_url": {"url": str}}`` in a
    message's ``content`` list; anything else is skipped (the shape is
    ``jobs.validate_messages``'s business).
    """
    found: list[tuple[int, int, str]] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "image_url":
                continue
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, Mapping) else None
            if isinstance(url, str):
                found.append((i, j, url))
    return found


def with_image_urls(
    messages: Sequence[Any], replacements: Mapping[tuple[int, int], str]
) -> list[dict[str, Any]]:
    """A deep copy of ``messages`` with the image parts ``{(i, j): new url}`` replaced.

    The input is not modified and shares no dict or list with the result; other
    keys of a part (``detail``...) are kept.

    Raises:
        ValueError: a key that names no image part (a caller's bug, not bad input).
    """
    present = {(i, j) for i, j, _ in image_urls(messages)}
    missing = sorted(set(replacements) - present)
    if missing:
        raise ValueError(f"not image parts: {', '.join(_where(i, j) for i, j in missing)}")
    result: list[dict[str, Any]] = copy.deepcopy(list(messages))
    for (i, j), url in replacements.items():
        result[i]["content"][j]["image_url"]["url"] = url
    return result


def _check_caps(sized: Sequence[tuple[str, int]]) -> None:
    total = 0
    for where, size in sized:
        if size > MAX_IMAGE_BYTES:
            raise ImageError(
                f"{where}: image of {size} bytes is over the cap of {MAX_IMAGE_BYTES} bytes"
            )
        total += size
    if total > MAX_REQUEST_IMAGE_BYTES:
        raise ImageError(
            f"{len(sized)} images of {total} bytes together are over the cap of "
            f"{MAX_REQUEST_IMAGE_BYTES} bytes per job"
        )


def check_caps(sizes: Sequence[int]) -> None:
    """Checks one job's image sizes in bytes (decoded) against seed 004's caps.

    Raises:
        ImageError: an image over :data:`MAX_IMAGE_BYTES` or a sum over
            :data:`MAX_REQUEST_IMAGE_BYTES`. The number of images is not capped.
    """
    _check_caps([(f"image {k + 1} of {len(sizes)}", size) for k, size in enumerate(sizes)])


@dataclass(frozen=True)
class ImagePlan:
    """A job's images sorted by transport (from :func:`plan_images`); keys are ``(i, j)``.

    Attributes:
        to_fetch: ``[(i, j, url)]``, every http(s) URL (the ``url`` transport).
        inline: ``{(i, j): bytes}`` decoded from every ``data:`` URL (``base64``
            and offloaded messages).
        declared: ``{(i, j): media type}`` as the data URLs label them.
        canonical: data URLs already as :func:`to_data_url` writes them for their
            declared type; when that is the sniffed type, the string is passed on.
    """

    to_fetch: list[tuple[int, int, str]] = field(default_factory=list)
    inline: dict[tuple[int, int], bytes] = field(default_factory=dict)
    declared: dict[tuple[int, int], str] = field(default_factory=dict)
    canonical: set[tuple[int, int]] = field(default_factory=set)

    @property
    def count(self) -> int:
        """How many images the job holds."""
        return len(self.to_fetch) + len(self.inline)


def plan_images(messages: Sequence[Any]) -> ImagePlan:
    """Sorts a job's image parts into URLs to fetch and inline data URLs (decoded here).

    Seed 000 step 5, seed 004: an image arrives as a signed http(s) URL (``url``)
    or a ``data:image/jpeg;base64,`` URL (``base64`` and offloaded messages).
    Inline sizes are checked against the caps before any fetch; formats are
    checked by :func:`finish_images`. ``plan.count == 0`` for a job without images.

    Raises:
        ImageError: a malformed data URL or invalid base64, a scheme other than
            ``data``, ``http`` and ``https``, or inline images over the caps; the
            message names the part (``messages[1].content[0]: ...``).
    """
    plan = ImagePlan()
    for i, j, url in image_urls(messages):
        scheme = url.split(":", 1)[0].strip().lower() if ":" in url else ""
        if scheme == "data":
            try:
                declared, data, canonical = _parse_data_url(url)
            except ImageError as exc:
                raise ImageError(f"{_where(i, j)}: {exc}") from None
            plan.inline[(i, j)] = data
            plan.declared[(i, j)] = declared
            if canonical:
                plan.canonical.add((i, j))
        elif scheme in ("http", "https"):
            plan.to_fetch.append((i, j, url))
        else:
            shown = scheme[:20] if scheme else "none"
            raise ImageError(f"{_where(i, j)}: image URL scheme {shown!r} is not served")
    _check_caps([(_where(i, j), len(data)) for (i, j), data in plan.inline.items()])
    return plan


def finish_images(
    messages: Sequence[Any],
    plan: ImagePlan,
    fetched: Mapping[tuple[int, int], bytes],
) -> list[dict[str, Any]]:
    """A new messages list with every image a checked ``data:`` URL of its sniffed type.

    ``fetched`` holds ``{(i, j): bytes}`` for every entry of ``plan.to_fetch``.
    All images are checked together against the caps, then each with
    :func:`check_decodable` (JPEG or PNG; seed 004), and each url becomes
    ``to_data_url(sniffed type, bytes)``: a PNG labelled ``image/jpeg`` becomes
    ``data:image/png;base64,...``, a fetched JPEG ``data:image/jpeg;base64,...``
    whatever its ``Content-Type``. A data URL in ``plan.canonical`` labelled with
    its sniffed type is kept as the same string. ``messages`` is not modified.
    More than :data:`MAX_IMAGES` images are let through with a warning.

    Raises:
        ImageError: an image not fetched, over the caps, or not a JPEG or PNG
            koboldcpp can read; the message names the part
            (``"messages[0].content[1]: GIF image, not JPEG or PNG"``).
        ValueError: ``plan`` or ``fetched`` does not match ``messages`` (a caller's bug).
    """
    wanted = {(i, j) for i, j, _ in plan.to_fetch}
    unknown = sorted(set(fetched) - wanted)
    if unknown:
        raise ValueError(f"fetched images not in the plan: {unknown}")
    present = {(i, j) for i, j, _ in image_urls(messages)}
    if present != wanted | set(plan.inline):
        raise ValueError("the plan does not match the messages")
    images: dict[tuple[int, int], bytes] = dict(plan.inline)
    for i, j, _url in plan.to_fetch:
        data = fetched.get((i, j))
        if data is None:
            raise ImageError(f"{_where(i, j)}: image was not fetched")
        images[(i, j)] = bytes(data)
    order = sorted(images)
    _check_caps([(_where(i, j), len(images[(i, j)])) for i, j in order])
    replacements: dict[tuple[int, int], str] = {}
    for i, j in order:
        data = images[(i, j)]
        try:
            media_type = check_decodable(data)
        except ImageError as exc:
            raise ImageError(f"{_where(i, j)}: {exc}") from None
        declared = plan.declared.get((i, j))
        if declared == media_type and (i, j) in plan.canonical:
            continue  # already what to_data_url would write: keep the string
        if declared is not None and declared != media_type:
            log.info(
                "%s: data URL labelled %r holds %s; relabelled",
                _where(i, j), declared or "(none)", media_type,
            )
        replacements[(i, j)] = to_data_url(media_type, data)
    if len(order) > MAX_IMAGES:
        log.warning(
            "job holds %d images; koboldcpp keeps only the last %d and answers without "
            "the first %d",
            len(order), MAX_IMAGES, len(order) - MAX_IMAGES,
        )
    if order:
        log.debug(
            "%d images checked, %d bytes", len(order), sum(len(d) for d in images.values())
        )
    return with_image_urls(messages, replacements)


def prepare_inline_images(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """``finish_images(messages, plan_images(messages), {})``: for a job whose images are
    all inline ``data:`` URLs. Raises ImageError as those do (an http(s) URL: not fetched)."""
    return finish_images(messages, plan_images(messages), {})
