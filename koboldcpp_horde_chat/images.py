"""Images of chat jobs: media type from the bytes, decodability, data URLs, caps (pure; no I/O).

Seed sections: "5. Serve images" and "7. Fault a job" (seed 000), and seed 004
("Send chat images to workers by the transport each worker declares").

koboldcpp reads an image only from an ``image_url`` part whose url starts with
``data:image``; it base64-decodes the text after the first comma and hands the
bytes to stb_image (``stbi_load_from_memory``), which finds the format by
itself. An http(s) URL is dropped silently, and so is an image stb_image cannot
decode (WebP, a truncated JPEG...): koboldcpp then answers as if there were no
image. So before a job reaches koboldcpp the worker turns every image into a
``data:`` URL whose bytes this module has checked, and faults the job (without
``fault_reason``, seed step 7: "an image cannot be fetched") when it cannot.

How the worker uses this module (the I/O stays in the worker)::

    plan = images.plan_images(messages)            # data: URLs decoded, http(s) URLs listed
    fetched = {(i, j): fetch.fetch_image(url, timeout_s=..., max_bytes=images.MAX_IMAGE_BYTES)
               for i, j, url in plan.to_fetch}     # the ``url`` transport, bounded fetches
    messages = images.finish_images(messages, plan, fetched)   # every image checked

:class:`ImageError` (a :class:`~koboldcpp_horde_chat.errors.FetchError`) is the
only error raised for bad input; messages never contain a URL or image bytes.

Supported formats follow stb_image v2.30 as vendored by koboldcpp 1.116.1
(``KOBOLDCPP_READABLE``): JPEG (baseline, extended and progressive Huffman,
8-bit), PNG, GIF (first frame), BMP (not RLE), PSD (RGB), Radiance HDR,
Softimage PIC, binary PGM/PPM (P5/P6) and TGA (with the TGA 2.0 footer).
:func:`check_decodable` walks each file's structure far enough to catch what
really happens to image bytes in transit (truncation) and the variants
stb_image refuses; it does not decode pixels or verify checksums (stb_image
does not verify them either).
"""

from __future__ import annotations

import binascii
import copy
import logging
import re
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from .errors import FetchError

log = logging.getLogger(__name__)

# --- media types ------------------------------------------------------------------

JPEG: Final = "image/jpeg"
PNG: Final = "image/png"
GIF: Final = "image/gif"
BMP: Final = "image/bmp"
TGA: Final = "image/x-tga"
PSD: Final = "image/vnd.adobe.photoshop"
HDR: Final = "image/vnd.radiance"
PIC: Final = "image/x-softimage-pic"
PGM: Final = "image/x-portable-graymap"
PPM: Final = "image/x-portable-pixmap"
PBM: Final = "image/x-portable-bitmap"
WEBP: Final = "image/webp"
TIFF: Final = "image/tiff"
AVIF: Final = "image/avif"
HEIC: Final = "image/heic"
HEIF: Final = "image/heif"
JXL: Final = "image/jxl"
JP2: Final = "image/jp2"
SVG: Final = "image/svg+xml"

KOBOLDCPP_READABLE: Final[frozenset[str]] = frozenset(
    {JPEG, PNG, GIF, BMP, TGA, PSD, HDR, PIC, PGM, PPM}
)
"""Media types koboldcpp's image loader (stb_image) decodes.

Notes on the edges (koboldcpp-facts §3; ``vendor/stb/stb_image.h``):

* ``image/webp``, ``image/avif``, ``image/heic``, ``image/tiff``, ``image/jxl``,
  ``image/svg+xml`` and PBM bitmaps (P1/P4) are not readable. They are still
  recognised by :func:`sniff_media_type`, so the fault names them.
* PGM/PPM are readable only in their binary forms P5/P6; the ASCII forms P2/P3
  share the media type and are refused by :func:`check_decodable`.
* TGA has no magic number at its start; stb_image tries it last, on a weak
  header test. A TGA is recognised here only when it ends with the TGA 2.0
  footer (``TRUEVISION-XFILE.`` and a NUL) and its header passes stb_image's
  test; an old-style TGA without the footer is an "unknown image format". The
  Horde stores every image as JPEG (seed 004), so this costs nothing in practice.
"""

# --- caps -----------------------------------------------------------------------

MIB: Final = 1024 * 1024

MAX_IMAGE_BYTES: Final = 10 * MIB
"""Cap on one image's bytes (10 MiB).

Seed 004 names per-image and per-request caps defined in the Horde's
``horde/chat_contract.py`` without stating their values. The images a worker
receives are the Horde's stored copies: JPEG, quality 90, longest side at most
2048 px (seed 004). Such a JPEG is a few hundred KiB for a photo and stays under
about 8 MiB even for pure noise (4.2 Mpx at about 15 bits per pixel with 4:2:0
chroma), so 10 MiB never refuses a stored image and bounds one download. Pass it
as ``max_bytes`` to ``fetch.fetch_image``.
"""

MAX_REQUEST_IMAGE_BYTES: Final = 27 * MIB
"""Cap on the sum of one job's image bytes (27 MiB).

Seed 004: "The body cap fits a request at every cap as base64 data URLs plus the
text allowance", and the body cap is 36 MiB (seed 000, "Fetch offloaded
messages"). Base64 makes 4 characters of 3 bytes, so the Horde's per-request
image total is below 36 MiB x 3/4 = 27 MiB; a job over it did not come from a
conforming Horde.
"""

MAX_IMAGES: Final = 16
"""koboldcpp keeps only the last 16 images of a request (koboldcpp-facts §3, L2156).

Not a cap: a job with more images is not faulted here, since the Horde's own
caps decide how many images a request may hold and seed 000 says to fault only
what the worker cannot serve. :func:`finish_images` logs a warning instead, so an
operator can see that koboldcpp will answer without the earliest ones.
"""

_STB_MAX_DIMENSION: Final = 1 << 24
"""stb_image's ``STBI_MAX_DIMENSIONS``: a larger width or height is refused."""
_STB_MAX_BUFFER: Final = (1 << 31) - 1
"""stb_image refuses images whose RGBA buffer would not fit a signed int."""


class ImageError(FetchError):
    """An image cannot be handed to koboldcpp: malformed, unreadable, truncated or over a cap.

    A subclass of :class:`~koboldcpp_horde_chat.errors.FetchError`, so the worker
    faults the job without ``fault_reason`` (seed 000 step 7: "an image cannot
    be fetched"; "A fetch that fails is a faulted job"). The message names the
    image's place (``messages[1].content[0]``) where known, never its URL or bytes.
    """


# --- sniffing -----------------------------------------------------------------------

_TGA_FOOTER: Final = b"TRUEVISION-XFILE.\x00"
_TGA_FOOTER_LEN: Final = 26
_TGA_HEADER_LEN: Final = 18
_PNM_SPACE: Final = b" \t\n\r\x0b\x0c"
_HEIC_BRANDS: Final = frozenset({b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis"})
_HEIF_BRANDS: Final = frozenset({b"mif1", b"msf1"})
_AVIF_BRANDS: Final = frozenset({b"avif", b"avis"})
_BMP_HEADER_SIZES: Final = frozenset({12, 16, 40, 52, 56, 64, 108, 124})
"""All BITMAPINFOHEADER sizes in use; stb_image reads 12, 40, 56, 108 and 124."""


def _tga_header_ok(data: bytes) -> bool:
    """stb_image's TGA header test (``stbi__tga_test``)."""
    if len(data) < _TGA_HEADER_LEN:
        return False
    cmap_type, image_type = data[1], data[2]
    width, height = struct.unpack_from("<HH", data, 12)
    bpp = data[16]
    if cmap_type == 1:
        if image_type not in (1, 9) or data[7] not in (8, 15, 16, 24, 32):
            return False
        if bpp not in (8, 16):
            return False
    elif cmap_type == 0:
        if image_type not in (2, 3, 10, 11):
            return False
    else:
        return False
    return width >= 1 and height >= 1 and bpp in (8, 15, 16, 24, 32)


def sniff_media_type(data: bytes) -> str | None:
    """The media type of an image, from its magic number alone.

    Never looks at a ``Content-Type`` header or a data URL's label (seed 000
    step 5: "take the media type from the bytes"; an object store may return a
    generic type).

    Args:
        data: the image bytes (any length, possibly empty or truncated).

    Returns:
        ``"image/jpeg"`` (``FF D8 FF``), ``"image/png"`` (``89 50 4E 47 0D 0A 1A
        0A``), ``"image/gif"`` (``GIF87a``/``GIF89a``), ``"image/bmp"`` (``BM``
        and a known info-header size), ``"image/vnd.adobe.photoshop"``
        (``8BPS``), ``"image/vnd.radiance"`` (``#?RADIANCE`` or ``#?RGBE`` and a
        newline), ``"image/x-softimage-pic"`` (``53 80 F6 34`` and ``PICT`` at
        byte 88), ``"image/x-portable-bitmap"``/``-graymap``/``-pixmap``
        (``P1``..``P6`` and a space), ``"image/x-tga"`` (TGA 2.0 footer, see
        :data:`KOBOLDCPP_READABLE`), and for formats koboldcpp cannot read:
        ``"image/webp"`` (``RIFF....WEBP``), ``"image/tiff"``, ``"image/avif"``,
        ``"image/heic"``, ``"image/heif"``, ``"image/jxl"``, ``"image/jp2"``,
        ``"image/svg+xml"``. None when no magic number matches.
    """
    head = bytes(data[:96])
    if head.startswith(b"\xff\xd8\xff"):
        return JPEG
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return PNG
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return GIF
    if head.startswith(b"BM") and len(head) >= 18:
        (header_size,) = struct.unpack_from("<I", head, 14)
        if header_size in _BMP_HEADER_SIZES:
            return BMP
    if head.startswith(b"8BPS"):
        return PSD
    if head.startswith((b"#?RADIANCE\n", b"#?RGBE\n")):
        return HDR
    if head.startswith(b"\x53\x80\xf6\x34") and head[88:92] == b"PICT":
        return PIC
    if len(head) >= 3 and head[0:1] == b"P" and head[2] in _PNM_SPACE:
        kind = head[1:2]
        if kind in (b"1", b"4"):
            return PBM
        if kind in (b"2", b"5"):
            return PGM
        if kind in (b"3", b"6"):
            return PPM
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return WEBP
    if head.startswith((b"II*\x00", b"MM\x00*")):
        return TIFF
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        if brand in _AVIF_BRANDS:
            return AVIF
        if brand in _HEIC_BRANDS:
            return HEIC
        if brand in _HEIF_BRANDS:
            return HEIF
    if head.startswith((b"\xff\x0a", b"\x00\x00\x00\x0cJXL \r\n\x87\n")):
        return JXL
    if head.startswith(b"\x00\x00\x00\x0cjP  \r\n\x87\n"):
        return JP2
    text = bytes(data[:1024]).lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if text.startswith(b"<svg") or (text.startswith(b"<?xml") and b"<svg" in text):
        return SVG
    if (
        len(data) >= _TGA_HEADER_LEN + _TGA_FOOTER_LEN
        and bytes(data[-len(_TGA_FOOTER):]) == _TGA_FOOTER
        and _tga_header_ok(head)
    ):
        return TGA
    return None


# --- structural checks --------------------------------------------------------------


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
    0xC5: "hierarchical JPEG",
    0xC6: "hierarchical JPEG",
    0xC7: "hierarchical JPEG",
    0xC9: "arithmetic-coded JPEG",
    0xCA: "arithmetic-coded JPEG",
    0xCB: "arithmetic-coded JPEG",
    0xCC: "arithmetic-coded JPEG",
    0xCD: "arithmetic-coded JPEG",
    0xCE: "arithmetic-coded JPEG",
    0xCF: "arithmetic-coded JPEG",
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


def _png_chunk_name(ctype: bytes) -> str:
    return ctype.decode("ascii") if ctype.isalpha() else ctype.hex()


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
            raise _unreadable(f"PNG with the unknown critical chunk {_png_chunk_name(ctype)}")
        pos = end
    assert size is not None
    return size


def _gif_skip_sub_blocks(data: bytes, pos: int) -> int:
    n = len(data)
    while True:
        if pos >= n:
            raise _truncated("GIF")
        block = data[pos]
        pos += 1
        if block == 0:
            return pos
        pos += block


def _check_gif(data: bytes) -> tuple[int, int]:
    """Walks a GIF's blocks to the trailer (0x3B); returns the logical screen size.

    At least one image must come before the trailer, each image must lie on the
    logical screen, have a colour table (local or global) and an LZW code size
    of at most 12 (stb_image's checks). Bytes after the trailer are ignored.
    """
    n = len(data)
    if n < 13:
        raise _truncated("GIF")
    width, height, flags = struct.unpack_from("<HHB", data, 6)
    if width == 0 or height == 0:
        raise _corrupt("GIF", "empty logical screen")
    pos = 13
    has_global = bool(flags & 0x80)
    if has_global:
        pos += 3 * (2 << (flags & 7))
    images = 0
    while True:
        if pos >= n:
            raise _truncated("GIF")
        tag = data[pos]
        pos += 1
        if tag == 0x3B:
            break
        if tag == 0x21:  # extension: label, then sub-blocks
            pos = _gif_skip_sub_blocks(data, pos + 1)
        elif tag == 0x2C:  # image descriptor
            if pos + 9 > n:
                raise _truncated("GIF")
            left, top, w, h, local = struct.unpack_from("<HHHHB", data, pos)
            pos += 9
            if left + w > width or top + h > height:
                raise _corrupt("GIF", "image outside the logical screen")
            if local & 0x80:
                pos += 3 * (2 << (local & 7))
            elif not has_global:
                raise _corrupt("GIF", "image without a colour table")
            if pos >= n:
                raise _truncated("GIF")
            if data[pos] > 12:
                raise _corrupt("GIF", "LZW code size")
            pos = _gif_skip_sub_blocks(data, pos + 1)
            images += 1
        else:
            raise _corrupt("GIF", f"unexpected block 0x{tag:02X} at byte {pos - 1}")
    if images == 0:
        raise _corrupt("GIF", "no image before the trailer")
    return width, height


def _check_bmp(data: bytes) -> tuple[int, int]:
    """Checks a BMP's headers as stb_image reads them and that every pixel row is present.

    Refused: RLE (compression 1, 2) and embedded JPEG/PNG (4, 5), bit depths
    other than 1, 4, 8, 16, 24 and 32, a palette image without 1 to 256 palette
    entries, a pixel-data offset stb_image rejects, and fewer bytes than the
    header's ``bfSize`` (when not 0) or than ``offset + row bytes x rows``.
    """
    n = len(data)
    if n < 18:
        raise _truncated("BMP")
    file_size, offset, header_size = struct.unpack_from("<I4xII", data, 2)
    if header_size not in (12, 40, 56, 108, 124):
        raise _unreadable(f"BMP with a {header_size}-byte info header")
    if n < 14 + header_size:
        raise _truncated("BMP")
    if header_size == 12:
        width, height, planes, bpp = struct.unpack_from("<HHHH", data, 18)
        compression = 0
    else:
        width, height, planes, bpp, compression = struct.unpack_from("<iiHHI", data, 18)
    if planes != 1:
        raise _corrupt("BMP", f"{planes} planes")
    if compression in (1, 2):
        raise _unreadable("RLE-compressed BMP")
    if compression >= 4:
        raise _unreadable(f"BMP with compression {compression} (embedded JPEG or PNG)")
    if bpp not in (1, 4, 8, 16, 24, 32):
        raise _unreadable(f"BMP with {bpp} bits per pixel")
    if compression == 3 and bpp not in (16, 32):
        raise _corrupt("BMP", "bit fields need 16 or 32 bits per pixel")
    if width <= 0 or height == 0:
        raise _corrupt("BMP", "no pixels")
    header_end = 14 + header_size + (12 if header_size in (40, 56) and compression == 3 else 0)
    if bpp < 16:
        entries = (offset - 38) // 3 if header_size == 12 else (offset - header_end) >> 2
        if not 1 <= entries <= 256:
            raise _corrupt("BMP", "palette size")
    elif not 0 <= offset - header_end <= 1024:
        raise _corrupt("BMP", "pixel data offset")
    row_bytes = (width * bpp + 31) // 32 * 4
    if offset + row_bytes * abs(height) > n or file_size > n:
        raise _truncated("BMP")
    return width, abs(height)


def _check_psd(data: bytes) -> tuple[int, int]:
    """Checks a PSD's header (version 1, RGB, 8 or 16 bits) and that its image data is present."""
    n = len(data)
    if n < 26:
        raise _truncated("PSD")
    version, channels, height, width, depth, mode = struct.unpack_from(">H6xHIIHH", data, 4)
    if version != 1:
        raise _unreadable(f"PSD version {version} (PSB)" if version == 2 else "PSD version")
    if not 1 <= channels <= 16:
        raise _corrupt("PSD", f"{channels} channels")
    if depth not in (8, 16):
        raise _unreadable(f"PSD with {depth}-bit channels")
    if mode != 3:
        raise _unreadable("PSD in a colour mode other than RGB")
    if width == 0 or height == 0:
        raise _corrupt("PSD", "no pixels")
    pos = 26
    for _section in ("colour mode data", "image resources", "layers and masks"):
        if pos + 4 > n:
            raise _truncated("PSD")
        (length,) = struct.unpack_from(">I", data, pos)
        pos += 4 + length
    if pos + 2 > n:
        raise _truncated("PSD")
    (compression,) = struct.unpack_from(">H", data, pos)
    pos += 2
    if compression == 0:
        needed = channels * width * height * (depth // 8)
    elif compression == 1:
        rows = channels * height
        if pos + 2 * rows > n:
            raise _truncated("PSD")
        needed = 2 * rows + sum(struct.unpack_from(f">{rows}H", data, pos))
    else:
        raise _unreadable(f"PSD with compression {compression}")
    if pos + needed > n:
        raise _truncated("PSD")
    return width, height


def _check_hdr(data: bytes) -> tuple[int, int]:
    """Checks a Radiance HDR (``FORMAT=32-bit_rle_rgbe``, ``-Y h +X w``) and its pixel data.

    Flat pixel data must be complete; run-length encoded scanlines are walked.
    """
    n = len(data)
    pos = data.index(b"\n") + 1  # the signature line; sniff_media_type checked it
    valid = False
    while True:
        k = data.find(b"\n", pos, pos + 1024)
        if k < 0:
            raise _truncated("HDR") if n - pos < 1024 else _corrupt("HDR", "header line")
        line = data[pos:k]
        pos = k + 1
        if not line:
            break
        if line == b"FORMAT=32-bit_rle_rgbe":
            valid = True
    if not valid:
        raise _unreadable("HDR in a format other than 32-bit_rle_rgbe")
    k = data.find(b"\n", pos, pos + 1024)
    if k < 0:
        raise _truncated("HDR")
    match = re.fullmatch(rb"-Y +(\d{1,9}) +\+X +(\d{1,9})", data[pos:k])
    if match is None:
        raise _unreadable("HDR with a pixel order other than -Y h +X w")
    height, width = int(match[1]), int(match[2])
    pos = k + 1
    if width == 0 or height == 0:
        raise _corrupt("HDR", "no pixels")
    if width * height * 12 > _STB_MAX_BUFFER:  # stb_image decodes HDR to 3 floats per pixel
        raise _unreadable(f"HDR of {width}x{height} pixels (too large)")
    scanline = data[pos : pos + 4]
    if 8 <= width < 32768 and scanline[:2] == b"\x02\x02" and len(scanline) == 4:
        if not scanline[2] & 0x80:
            _hdr_walk_runs(data, pos, width, height)
            return width, height
    if pos + 4 * width * height > n:
        raise _truncated("HDR")
    return width, height


def _hdr_walk_runs(data: bytes, pos: int, width: int, height: int) -> None:
    """Walks run-length encoded HDR scanlines as stb_image decodes them."""
    n = len(data)
    for _row in range(height):
        if pos + 4 > n:
            raise _truncated("HDR")
        if data[pos] != 2 or data[pos + 1] != 2 or data[pos + 2] & 0x80:
            raise _corrupt("HDR", "flat scanline among run-length encoded ones")
        if (data[pos + 2] << 8) | data[pos + 3] != width:
            raise _corrupt("HDR", "scanline length")
        pos += 4
        for _component in range(4):
            left = width
            while left > 0:
                if pos >= n:
                    raise _truncated("HDR")
                count = data[pos]
                if count > 128:  # a run: one value repeated
                    count -= 128
                    step = 2
                else:  # literal values
                    step = 1 + count
                if count == 0 or count > left:
                    raise _corrupt("HDR", "run length")
                pos += step
                left -= count
            if pos > n:
                raise _truncated("HDR")


def _check_pic(data: bytes) -> tuple[int, int]:
    """Checks a Softimage PIC's header and channel packets; uncompressed data must be complete."""
    n = len(data)
    if n < 104:
        raise _truncated("PIC")
    width, height = struct.unpack_from(">HH", data, 92)
    if width == 0 or height == 0:
        raise _corrupt("PIC", "no pixels")
    pos = 104
    packets: list[tuple[int, int]] = []
    while True:
        if pos + 4 > n:
            raise _truncated("PIC")
        chained, bits, kind, channels = data[pos : pos + 4]
        pos += 4
        if len(packets) == 10:
            raise _corrupt("PIC", "more than 10 channel packets")
        if bits != 8:
            raise _unreadable(f"PIC with {bits}-bit channels")
        if kind > 2:
            raise _corrupt("PIC", f"packet compression {kind}")
        packets.append((kind, channels))
        if not chained:
            break
    if all(kind == 0 for kind, _ in packets):
        per_pixel = sum(bin(channels & 0xF0).count("1") for _, channels in packets)
        if pos + per_pixel * width * height > n:
            raise _truncated("PIC")
    elif pos >= n:
        raise _truncated("PIC")
    return width, height


_PNM_SKIP: Final = re.compile(rb"(?:[ \t\n\r\x0b\x0c]+|#[^\n\r]*)*")
_PNM_DIGITS: Final = re.compile(rb"\d+")


def _check_pnm(data: bytes) -> tuple[int, int]:
    """Checks a binary PGM/PPM (P5/P6) header and that all its samples are present.

    The header is three decimal numbers (width, height, maximum value) after the
    magic, separated by whitespace or ``#`` comments, and one whitespace byte
    before the samples; a maximum value above 255 means two bytes per sample.
    """
    kind = data[1:2]
    if kind in (b"2", b"3"):
        raise _unreadable(f"ASCII PNM (P{kind.decode()})")
    n = len(data)
    pos = 2
    values: list[int] = []
    for _name in ("width", "height", "maximum value"):
        skip = _PNM_SKIP.match(data, pos)
        pos = skip.end() if skip else pos
        digits = _PNM_DIGITS.match(data, pos)
        if digits is None:
            raise _truncated("PNM") if pos >= n else _corrupt("PNM", "header")
        if len(digits[0]) > 10:
            raise _corrupt("PNM", "number too large")
        values.append(int(digits[0]))
        pos = digits.end()
    width, height, maxval = values
    if pos >= n:
        raise _truncated("PNM")
    if data[pos] not in _PNM_SPACE:
        raise _corrupt("PNM", "header")
    pos += 1
    if width == 0 or height == 0:
        raise _corrupt("PNM", "no pixels")
    if not 1 <= maxval <= 65535:
        raise _corrupt("PNM", f"maximum value {maxval}")
    samples = width * height * (3 if kind == b"6" else 1) * (2 if maxval > 255 else 1)
    if pos + samples > n:
        raise _truncated("PNM")
    return width, height


def _check_tga(data: bytes) -> tuple[int, int]:
    """Checks a TGA (header as sniffed); uncompressed pixel data must be complete."""
    id_length, cmap_type, image_type = data[0], data[1], data[2]
    cmap_length, cmap_bits = struct.unpack_from("<HB", data, 5)
    width, height, bpp = struct.unpack_from("<HHB", data, 12)
    palette = cmap_length * ((cmap_bits + 7) // 8) if cmap_type else 0
    pixels_at = _TGA_HEADER_LEN + id_length + palette
    end = len(data) - _TGA_FOOTER_LEN
    if image_type in (1, 2, 3):
        needed = width * height * ((bpp + 7) // 8)
    else:
        needed = 1  # run-length encoded: not walked
    if pixels_at + needed > end:
        raise _truncated("TGA")
    return width, height


_CHECKERS: Final[Mapping[str, Callable[[bytes], tuple[int, int]]]] = {
    JPEG: _check_jpeg,
    PNG: _check_png,
    GIF: _check_gif,
    BMP: _check_bmp,
    PSD: _check_psd,
    HDR: _check_hdr,
    PIC: _check_pic,
    PGM: _check_pnm,
    PPM: _check_pnm,
    TGA: _check_tga,
}


def check_decodable(data: bytes) -> str:
    """The media type of an image koboldcpp can read; raises when it cannot.

    Sniffs the type from the magic number (:func:`sniff_media_type`), refuses
    types outside :data:`KOBOLDCPP_READABLE`, then walks the file's structure:

    * JPEG: segments from SOI to the EOI marker ``FF D9`` (bytes after it, such
      as zero padding, are ignored); a baseline, extended or progressive Huffman
      frame header (SOF0/1/2) with 8-bit samples before the first scan.
    * PNG: IHDR first, IDAT present, an IEND chunk at the end.
    * GIF: every block up to the trailer ``0x3B``, at least one image.
    * BMP: a header stb_image reads (not RLE), file-size field and pixel rows
      within the data.
    * PSD, HDR, PNM: the header and the complete pixel data (PackBits row
      counts, HDR runs walked).
    * PIC, TGA: the header, and the complete pixel data when uncompressed; their
      run-length encoded forms are checked by header only.

    Args:
        data: the image bytes (decoded from base64 or fetched).

    Returns:
        The sniffed media type, e.g. ``"image/jpeg"``; always in
        :data:`KOBOLDCPP_READABLE`.

    Raises:
        ImageError: ``"empty image"``; ``"unknown image format (first bytes
            ...)"``; ``"image/webp is not readable by koboldcpp"`` (and so on for
            other unreadable types or variants, e.g. ``"RLE-compressed BMP is not
            readable by koboldcpp"``); ``"truncated JPEG"`` (``PNG``, ``GIF``...);
            ``"corrupt JPEG: ..."``; an image larger than stb_image decodes.
    """
    if not data:
        raise ImageError("empty image")
    data = bytes(data)
    media_type = sniff_media_type(data)
    if media_type is None:
        raise ImageError(f"unknown image format (first bytes {data[:8].hex(' ')})")
    if media_type not in KOBOLDCPP_READABLE:
        raise _unreadable(media_type)
    width, height = _CHECKERS[media_type](data)
    if (
        width > _STB_MAX_DIMENSION
        or height > _STB_MAX_DIMENSION
        or width * height * 4 > _STB_MAX_BUFFER
    ):
        raise _unreadable(f"image of {width}x{height} pixels (too large)")
    return media_type


# --- data URLs ---------------------------------------------------------------------

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
    The scheme, media type and ``base64`` token are case-insensitive; parameters
    between the media type and ``;base64`` (``;charset=...``) are ignored.
    Whitespace and line breaks inside the base64 text are removed; the rest is
    decoded strictly (standard alphabet, correct ``=`` padding, nothing after
    it). The declared type is only a label: use :func:`check_decodable` for the
    real one.

    Returns:
        ``(media_type, data)``: the declared type in lower case (``""`` when the
        URL declares none) and the non-empty decoded bytes.

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
    """``"data:<media_type>;base64,<standard base64 of data, padded, no line breaks>"``.

    This is the form koboldcpp reads: a url starting with ``data:image`` whose
    text after the first comma is base64 (koboldcpp-facts §3).
    """
    return f"data:{media_type};base64,{binascii.b2a_base64(data, newline=False).decode('ascii')}"


# --- image parts in messages -------------------------------------------------------


def _where(i: int, j: int) -> str:
    return f"messages[{i}].content[{j}]"


def image_urls(messages: Sequence[Any]) -> list[tuple[int, int, str]]:
    """Every ``image_url`` part of a conversation, in order.

    Args:
        messages: ``[{"role": ..., "content": str | None | [part, ...]}, ...]``;
            an image part is ``{"type": "image_url", "image_url": {"url": str}}``.

    Returns:
        ``[(message index, part index, url), ...]``. Parts that are not image
        parts, or whose ``image_url.url`` is not a string, are skipped (the
        shape is ``jobs.validate_messages``'s business).
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
    """A deep copy of ``messages`` with the given image parts' urls replaced.

    The input is never modified, and the result shares no dict or list with it
    (strings are shared; they are immutable). Other keys of a part and of its
    ``image_url`` object (``detail``...) are kept.

    Args:
        messages: as for :func:`image_urls`.
        replacements: ``{(message index, part index): new url}``.

    Raises:
        ValueError: a key that does not name an image part of ``messages``
            (a caller's bug, not bad input).
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
    """Checks one job's image sizes against the caps (seed 004's per-image and per-request caps).

    Args:
        sizes: each image's size in bytes (decoded, not base64).

    Raises:
        ImageError: an image over :data:`MAX_IMAGE_BYTES` (10 MiB), or a sum over
            :data:`MAX_REQUEST_IMAGE_BYTES` (27 MiB). The number of images is not
            capped (see :data:`MAX_IMAGES`).
    """
    _check_caps([(f"image {k + 1} of {len(sizes)}", size) for k, size in enumerate(sizes)])


@dataclass(frozen=True)
class ImagePlan:
    """What a job's images need before koboldcpp can read them (from :func:`plan_images`).

    Attributes:
        to_fetch: ``[(message index, part index, url), ...]`` for every http(s)
            image URL (the ``url`` transport): the worker fetches each with
            ``fetch.fetch_image(url, timeout_s=..., max_bytes=MAX_IMAGE_BYTES)``.
        inline: ``{(message index, part index): bytes}`` decoded from every
            ``data:`` URL (the ``base64`` transport and offloaded messages).
        declared: ``{(message index, part index): media type}`` as the data URLs
            label them (the bytes decide the type sent to koboldcpp).
        canonical: the data URLs already written as :func:`to_data_url` would
            write them for their declared type; one whose declared type is also
            the sniffed type is passed on as it is, not rebuilt.
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
    """Sorts a job's image parts into URLs to fetch and inline data URLs to decode.

    Seed 000 step 5 and seed 004: an image arrives as a signed http(s) URL (the
    ``url`` transport) or as a ``data:image/jpeg;base64,`` URL (``base64``, and
    inside offloaded messages). Inline images are decoded here and their sizes
    checked against the caps, so a job that cannot be served fails before any
    fetch; the formats are checked by :func:`finish_images`.

    Args:
        messages: the job's conversation (validated by ``jobs.validate_messages``).

    Returns:
        An :class:`ImagePlan`; ``plan.count == 0`` for a job without images.

    Raises:
        ImageError: a malformed data URL or invalid base64, a URL scheme other
            than ``data``, ``http`` and ``https``, or inline images over the caps.
            The message names the part (``messages[1].content[0]: ...``).
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
    """The conversation with every image as a checked ``data:`` URL of its sniffed type.

    Checks all images of the job together against the caps, then each with
    :func:`check_decodable`, and replaces every image part's url by
    ``to_data_url(sniffed type, bytes)``: a PNG labelled ``image/jpeg`` becomes
    ``data:image/png;base64,...``; a fetched JPEG becomes
    ``data:image/jpeg;base64,...`` whatever its ``Content-Type`` was. A data URL
    already in that form (``plan.canonical``, labelled with its sniffed type) is
    kept as it is: the same string, not a rebuilt copy. A job with more than
    :data:`MAX_IMAGES` images is let through with a warning.

    Args:
        messages: the same conversation :func:`plan_images` was given (not modified).
        plan: its :class:`ImagePlan`.
        fetched: ``{(message index, part index): bytes}`` for every entry of
            ``plan.to_fetch``.

    Returns:
        A new messages list (see :func:`with_image_urls`), also for a job
        without images; ``messages`` is not modified.

    Raises:
        ImageError: an image in ``plan.to_fetch`` missing from ``fetched``, the
            caps, or an image koboldcpp cannot read (see :func:`check_decodable`);
            the message names the part.
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
    """:func:`finish_images` for a job whose images are all inline ``data:`` URLs.

    For the ``base64`` transport and offloaded messages: equal to
    ``finish_images(messages, plan_images(messages), {})``.

    Raises:
        ImageError: as :func:`plan_images` and :func:`finish_images`; an http(s)
            image URL is reported as not fetched (this function does no I/O).
    """
    return finish_images(messages, plan_images(messages), {})
