"""Images for koboldcpp: media type from the bytes, JPEG/PNG checks, data URLs, caps.

Seed 000 step 5 ("take the media type from the bytes"; "A fetch that fails is a
faulted job") and seed 004 (images stored as JPEG; per-image and per-request
caps). JPEG is what the Horde sends and PNG is accepted too; every other type is
faulted by its name. The JPEG, PNG and GIF below are real files built with the
standard library only (a small baseline and progressive JPEG encoder, PNG with
zlib, GIF with a tiny LZW stream), each checked once, outside this suite, to
decode with the stb_image that koboldcpp 1.116.1 vendors; the other formats are
represented by their real headers.
"""

from __future__ import annotations

import base64
import copy
import logging
import math
import struct
import zlib
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from koboldcpp_horde_chat.errors import FetchError
from koboldcpp_horde_chat.translate.images import (
    ACCEPTED,
    MAX_IMAGE_BYTES,
    MAX_IMAGES,
    MAX_REQUEST_IMAGE_BYTES,
    ImageError,
    ImagePlan,
    check_decodable,
    finish_images,
    image_urls,
    plan_images,
    sniff_media_type,
    to_data_url,
)

MIB = 1024 * 1024


def colour(x: int, y: int) -> tuple[int, int, int]:
    """A test pattern: every pixel differs from its neighbours."""
    return (x * 70 + 20) % 256, (y * 90 + 40) % 256, ((x + y) * 50 + 60) % 256


# --- JPEG: a small encoder (baseline or progressive, Huffman, 8-bit, 4:4:4) ------------

ZIGZAG = [
    (row, s - row)
    for s in range(15)
    for row in (range(max(0, s - 7), min(s, 7) + 1) if s % 2 else range(min(s, 7), max(0, s - 7) - 1, -1))
]
COS = [[math.cos((2 * x + 1) * u * math.pi / 16) for u in range(8)] for x in range(8)]
QUANT = 4
# Our own Huffman tables: the 12 DC categories as 4-bit codes, the 162 AC
# symbols (EOB, ZRL, run/size pairs) as 8-bit codes, in the order listed.
DC_SYMBOLS = list(range(12))
AC_SYMBOLS = [0x00, 0xF0] + [(run << 4) | size for run in range(16) for size in range(1, 11)]
DC_CODES = {sym: (k, 4) for k, sym in enumerate(DC_SYMBOLS)}
AC_CODES = {sym: (k, 8) for k, sym in enumerate(AC_SYMBOLS)}


class BitWriter:
    def __init__(self) -> None:
        self.out = bytearray()
        self.acc = 0
        self.bits = 0

    def write(self, value: int, length: int) -> None:
        self.acc = (self.acc << length) | (value & ((1 << length) - 1))
        self.bits += length
        while self.bits >= 8:
            self.bits -= 8
            byte = (self.acc >> self.bits) & 0xFF
            self.out.append(byte)
            if byte == 0xFF:
                self.out.append(0x00)

    def flush(self) -> bytes:
        if self.bits:
            self.write((1 << (8 - self.bits)) - 1, 8 - self.bits)
        self.acc = 0
        return bytes(self.out)


def zigzag_block(plane: list[list[float]], bx: int, by: int) -> list[int]:
    """The quantised DCT coefficients of one 8x8 block, in zigzag order."""
    block = [[plane[by * 8 + y][bx * 8 + x] - 128 for x in range(8)] for y in range(8)]
    coefficients = []
    for v, u in ZIGZAG:
        total = sum(block[y][x] * COS[x][u] * COS[y][v] for y in range(8) for x in range(8))
        cu = 1 / math.sqrt(2) if u == 0 else 1.0
        cv = 1 / math.sqrt(2) if v == 0 else 1.0
        coefficients.append(round(0.25 * cu * cv * total / QUANT))
    return coefficients


def encode_dc(writer: BitWriter, diff: int) -> None:
    size = abs(diff).bit_length()
    writer.write(*DC_CODES[size])
    if size:
        writer.write(diff if diff > 0 else diff + (1 << size) - 1, size)


def encode_ac(writer: BitWriter, coefficients: list[int]) -> None:
    run = 0
    for value in coefficients[1:]:
        if value == 0:
            run += 1
            continue
        while run > 15:
            writer.write(*AC_CODES[0xF0])
            run -= 16
        size = abs(value).bit_length()
        assert size <= 10
        writer.write(*AC_CODES[(run << 4) | size])
        writer.write(value if value > 0 else value + (1 << size) - 1, size)
        run = 0
    if run:
        writer.write(*AC_CODES[0x00])


def segment(marker: int, body: bytes) -> bytes:
    return struct.pack(">BBH", 0xFF, marker, len(body) + 2) + body


def huffman_table(table_class: int, symbols: list[int], length: int) -> bytes:
    counts = [0] * 16
    counts[length - 1] = len(symbols)
    return bytes([table_class << 4]) + bytes(counts) + bytes(symbols)


def jpeg(
    width: int = 16,
    height: int = 8,
    *,
    components: int = 3,
    progressive: bool = False,
    restart_interval: int = 0,
    sof: int | None = None,
) -> bytes:
    """A real JPEG of the test pattern (JFIF, one quantisation table, 1x1 sampling)."""
    pad_w, pad_h = -(-width // 8) * 8, -(-height // 8) * 8
    rgb = [[colour(min(x, width - 1), min(y, height - 1)) for x in range(pad_w)] for y in range(pad_h)]
    if components == 3:
        planes = [
            [[0.299 * r + 0.587 * g + 0.114 * b for r, g, b in row] for row in rgb],
            [[-0.168736 * r - 0.331264 * g + 0.5 * b + 128 for r, g, b in row] for row in rgb],
            [[0.5 * r - 0.418688 * g - 0.081312 * b + 128 for r, g, b in row] for row in rgb],
        ]
    else:
        planes = [[[0.299 * r + 0.587 * g + 0.114 * b for r, g, b in row] for row in rgb]]
    blocks_x, blocks_y = pad_w // 8, pad_h // 8
    coefficients = [
        [[zigzag_block(plane, bx, by) for bx in range(blocks_x)] for by in range(blocks_y)]
        for plane in planes
    ]
    ids = list(range(1, components + 1))
    out = bytearray(b"\xff\xd8")
    out += segment(0xE0, b"JFIF\x00" + struct.pack(">BBBHHBB", 1, 1, 0, 1, 1, 0, 0))
    out += segment(0xDB, b"\x00" + bytes([QUANT] * 64))
    frame = struct.pack(">BHHB", 8, height, width, components)
    frame += b"".join(bytes([cid, 0x11, 0]) for cid in ids)
    out += segment(sof if sof is not None else (0xC2 if progressive else 0xC0), frame)
    out += segment(0xC4, huffman_table(0, DC_SYMBOLS, 4))
    out += segment(0xC4, huffman_table(1, AC_SYMBOLS, 8))
    if restart_interval:
        out += segment(0xDD, struct.pack(">H", restart_interval))

    def scan_header(scan_ids: list[int], start: int, end: int) -> bytes:
        body = bytes([len(scan_ids)]) + b"".join(bytes([cid, 0x00]) for cid in scan_ids)
        return segment(0xDA, body + bytes([start, end, 0]))

    if not progressive:
        out += scan_header(ids, 0, 63)
        writer = BitWriter()
        predictors = [0] * components
        mcu = 0
        for by in range(blocks_y):
            for bx in range(blocks_x):
                if restart_interval and mcu and mcu % restart_interval == 0:
                    out += writer.flush()
                    writer = BitWriter()
                    out += bytes([0xFF, 0xD0 + (mcu // restart_interval - 1) % 8])
                    predictors = [0] * components
                for c in range(components):
                    block = coefficients[c][by][bx]
                    encode_dc(writer, block[0] - predictors[c])
                    predictors[c] = block[0]
                    encode_ac(writer, block)
                mcu += 1
        out += writer.flush()
    else:
        # First scan: the DC coefficients of all components; then one AC scan each.
        out += scan_header(ids, 0, 0)
        writer = BitWriter()
        predictors = [0] * components
        for by in range(blocks_y):
            for bx in range(blocks_x):
                for c in range(components):
                    block = coefficients[c][by][bx]
                    encode_dc(writer, block[0] - predictors[c])
                    predictors[c] = block[0]
        out += writer.flush()
        for c in range(components):
            out += scan_header([ids[c]], 1, 63)
            writer = BitWriter()
            for by in range(blocks_y):
                for bx in range(blocks_x):
                    encode_ac(writer, coefficients[c][by][bx])
            out += writer.flush()
    out += b"\xff\xd9"
    return bytes(out)


# --- PNG, and the formats that are faulted -----------------------------------------------


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png(
    width: int = 3,
    height: int = 2,
    *,
    before: list[bytes] | None = None,
    after_ihdr: list[bytes] | None = None,
    end: bool = True,
) -> bytes:
    """A real RGB PNG of the test pattern."""
    raw = b"".join(
        b"\x00" + b"".join(bytes(colour(x, y)) for x in range(width)) for y in range(height)
    )
    ihdr = png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    data = b"\x89PNG\r\n\x1a\n" + b"".join(before or []) + ihdr + b"".join(after_ihdr or [])
    data += png_chunk(b"IDAT", zlib.compress(raw))
    return data + (png_chunk(b"IEND", b"") if end else b"")


def palette_png(*, with_plte: bool = True) -> bytes:
    ihdr = png_chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 1, 8, 3, 0, 0, 0))
    plte = png_chunk(b"PLTE", bytes([255, 0, 0, 0, 0, 255])) if with_plte else b""
    idat = png_chunk(b"IDAT", zlib.compress(b"\x00\x00\x01"))
    return b"\x89PNG\r\n\x1a\n" + ihdr + plte + idat + png_chunk(b"IEND", b"")


def gif(width: int = 3, height: int = 2) -> bytes:
    """A real GIF89a: 4-colour global table; LZW with a clear code before every two pixels."""
    pixels = [(x + y) % 4 for y in range(height) for x in range(width)]
    codes: list[int] = []
    for k in range(0, len(pixels), 2):
        codes += [4, *pixels[k : k + 2]]  # clear, then two literals: codes stay 3 bits
    codes.append(5)  # end of information
    acc = 0
    for k, code in enumerate(codes):
        acc |= code << (3 * k)
    stream = acc.to_bytes(-(-3 * len(codes) // 8), "little")
    blocks = b"".join(bytes([len(stream[k : k + 255])]) + stream[k : k + 255] for k in range(0, len(stream), 255))
    head = b"GIF89a" + struct.pack("<HHBBB", width, height, 0x81, 0, 0)
    table = bytes([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255])
    control = b"\x21\xf9\x04\x00\x00\x00\x00\x00"  # a graphic control extension
    image = b"\x2c" + struct.pack("<HHHHB", 0, 0, width, height, 0) + b"\x02" + blocks + b"\x00"
    return head + table + control + image + b"\x3b"


def webp() -> bytes:
    """The header of a 1x1 lossless WebP (RIFF, WEBP, a VP8L chunk)."""
    vp8l = b"\x2f" + (0).to_bytes(4, "little") + b"\x00\x00\x00\x00\x00"
    body = b"WEBP" + b"VP8L" + struct.pack("<I", len(vp8l)) + vp8l
    return b"RIFF" + struct.pack("<I", len(body)) + body


READABLE: dict[str, tuple[Callable[[], bytes], str]] = {
    "baseline JPEG": (jpeg, "image/jpeg"),
    "greyscale JPEG": (lambda: jpeg(9, 9, components=1), "image/jpeg"),
    "progressive JPEG": (lambda: jpeg(progressive=True), "image/jpeg"),
    "JPEG with restart markers": (lambda: jpeg(24, 16, restart_interval=2), "image/jpeg"),
    "PNG": (png, "image/png"),
    "palette PNG": (palette_png, "image/png"),
}


TGA_HEADER = struct.pack("<BBBHHBHHHHBB", 0, 0, 2, 0, 0, 0, 0, 0, 1, 1, 24, 0x20)  # 1x1, 24-bit
PIC_HEADER = b"\x53\x80\xf6\x34" + struct.pack(">f", 3.71) + b"test".ljust(80, b"\x00") + b"PICT"

FAULTED: dict[str, tuple[bytes, str]] = {
    # name in the fault: (a real image of that format, or its real header; sniffed type)
    "GIF": (gif(), "image/gif"),
    "WebP": (webp(), "image/webp"),
    "BMP": (
        b"BM" + struct.pack("<IHHII", 58, 0, 0, 54, 40)
        + struct.pack("<iiHHIIiiII", 1, 1, 1, 24, 0, 4, 2835, 2835, 0, 0) + b"\x00\x00\xff\x00",
        "image/bmp",
    ),
    "TGA": (TGA_HEADER + b"\x00\x00\xff" + bytes(8) + b"TRUEVISION-XFILE.\x00", "image/x-tga"),
    "PSD": (
        b"8BPS" + struct.pack(">H6xHIIHH", 1, 3, 1, 1, 8, 3) + bytes(12) + b"\x00\x00\xff\x00\x00",
        "image/vnd.adobe.photoshop",
    ),
    "Radiance HDR": (
        b"#?RADIANCE\nFORMAT=32-bit_rle_rgbe\n\n-Y 1 +X 1\n\x80\x40\x20\x81", "image/vnd.radiance"
    ),
    "Softimage PIC": (
        PIC_HEADER + struct.pack(">HHfHH", 1, 1, 1.0, 3, 0) + b"\x00\x08\x00\xe0\xff\x00\x00",
        "image/x-softimage-pic",
    ),
    "PBM": (b"P4\n8 1\n\xff", "image/x-portable-bitmap"),
    "PGM": (b"P5\n# a comment\n1 1\n255\n\x80", "image/x-portable-graymap"),
    "PPM": (b"P6 1 1 255\n\xff\x00\x00", "image/x-portable-pixmap"),
    "TIFF": (b"II*\x00\x08\x00\x00\x00" + b"\x00" * 16, "image/tiff"),
    "AVIF": (b"\x00\x00\x00\x1cftypavif\x00\x00\x00\x00avifmif1", "image/avif"),
    "HEIC": (b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic", "image/heic"),
    "HEIF": (b"\x00\x00\x00\x18ftypmif1\x00\x00\x00\x00mif1miaf", "image/heif"),
    "JPEG XL": (b"\xff\x0a\xfa\x7f", "image/jxl"),
    "JPEG 2000": (b"\x00\x00\x00\x0cjP  \r\n\x87\n\x00\x00\x00\x14ftypjp2 ", "image/jp2"),
    "SVG": (b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg"/>', "image/svg+xml"),
}


def image_message(*urls: str, text: str = "What is this?") -> dict[str, object]:
    parts: list[dict[str, object]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url, "detail": "auto"}} for url in urls]
    return {"role": "user", "content": parts}


# --- sniffing and decodability ----------------------------------------------------------


@pytest.mark.parametrize("name", list(READABLE))
def test_each_readable_format_is_sniffed_from_its_bytes_and_passes(name: str) -> None:
    build, media_type = READABLE[name]
    data = build()
    assert sniff_media_type(data) == media_type
    assert check_decodable(data) == media_type
    assert media_type in ACCEPTED


@pytest.mark.parametrize("name", list(READABLE))
def test_every_truncation_of_a_readable_image_is_refused(name: str) -> None:
    data = READABLE[name][0]()
    for cut in range(len(data)):
        with pytest.raises(ImageError):
            check_decodable(data[:cut])


def test_a_truncated_jpeg_names_the_problem() -> None:
    data = jpeg()
    with pytest.raises(ImageError, match="^truncated JPEG$"):
        check_decodable(data[: len(data) // 2])
    with pytest.raises(ImageError, match="^truncated JPEG$"):
        check_decodable(data[:-2])  # everything but the EOI marker


def test_a_truncated_png_names_its_format() -> None:
    with pytest.raises(ImageError, match="^truncated PNG$"):
        check_decodable(png()[:-1])


def test_zero_padding_after_the_end_of_an_image_is_accepted() -> None:
    assert check_decodable(jpeg() + b"\x00" * 100) == "image/jpeg"
    assert check_decodable(png() + b"\x00" * 7) == "image/png"


def test_a_cut_jpeg_padded_with_zeros_is_still_truncated() -> None:
    data = jpeg()
    with pytest.raises(ImageError, match="truncated JPEG"):
        check_decodable(data[: len(data) - 40] + b"\x00" * 40)


@pytest.mark.parametrize("name", list(FAULTED))
def test_every_other_format_is_faulted_by_its_sniffed_type(name: str) -> None:
    """Seed 004: the Horde sends every image as the JPEG it stored; no other type is walked."""
    data, media_type = FAULTED[name]
    assert sniff_media_type(data) == media_type
    assert media_type not in ACCEPTED
    with pytest.raises(ImageError, match=f"^{name} image, not JPEG or PNG$"):
        check_decodable(data)


@pytest.mark.parametrize(
    "data",
    [gif()[:10], gif() + b"junk", b"P3\n1 1\n255\n255 0 0\n", webp()[:12]],
    ids=["truncated GIF", "GIF with junk", "ASCII PPM", "WebP header only"],
)
def test_another_format_is_faulted_by_name_whatever_its_structure(data: bytes) -> None:
    with pytest.raises(ImageError, match="^(GIF|PPM|WebP) image, not JPEG or PNG$"):
        check_decodable(data)


@pytest.mark.parametrize(
    "data",
    [
        b"hello world",
        b"\x00" * 64,
        b'{"error": "expired"}',
        b"<html><body>Access denied</body></html>",
        TGA_HEADER + b"\x00\x00\xff",  # a TGA without the TGA 2.0 footer has no magic number
    ],
)
def test_bytes_that_are_no_image_are_an_unknown_format(data: bytes) -> None:
    assert sniff_media_type(data) is None
    with pytest.raises(ImageError, match="^unknown image format"):
        check_decodable(data)


def test_an_empty_image_is_refused() -> None:
    with pytest.raises(ImageError, match="^empty image$"):
        check_decodable(b"")


def replace_marker(data: bytes, old: int, new: int) -> bytes:
    at = data.index(bytes([0xFF, old]))
    return data[:at] + bytes([0xFF, new]) + data[at + 2 :]


@pytest.mark.parametrize(
    ("sof", "message"),
    [
        (0xC3, "lossless JPEG is not readable by koboldcpp"),
        (0xC9, "arithmetic-coded JPEG is not readable by koboldcpp"),
        (0xC5, "hierarchical JPEG is not readable by koboldcpp"),
    ],
)
def test_jpeg_coding_processes_stb_image_lacks_are_refused(sof: int, message: str) -> None:
    with pytest.raises(ImageError, match=f"^{message}$"):
        check_decodable(jpeg(sof=sof))


def test_the_extended_sequential_jpeg_frame_is_accepted() -> None:
    assert check_decodable(jpeg(sof=0xC1)) == "image/jpeg"


def test_a_12_bit_jpeg_is_refused() -> None:
    data = bytearray(jpeg())
    sof = data.index(b"\xff\xc0")
    data[sof + 4] = 12
    with pytest.raises(ImageError, match="^12-bit JPEG is not readable by koboldcpp$"):
        check_decodable(bytes(data))


def test_a_jpeg_scan_before_its_frame_header_is_corrupt() -> None:
    data = jpeg()
    start = data.index(b"\xff\xc0")
    length = struct.unpack_from(">H", data, start + 2)[0]
    without_frame = data[:start] + data[start + 2 + length :]
    with pytest.raises(ImageError, match="^corrupt JPEG: scan before the frame header$"):
        check_decodable(without_frame)


def test_a_jpeg_without_a_scan_is_corrupt() -> None:
    data = jpeg()
    header_end = data.index(b"\xff\xda")
    with pytest.raises(ImageError, match="^corrupt JPEG: no image data$"):
        check_decodable(data[:header_end] + b"\xff\xd9")


def test_a_png_whose_first_chunk_is_not_ihdr_is_corrupt() -> None:
    data = png(before=[png_chunk(b"tEXt", b"Comment\x00hi")])
    with pytest.raises(ImageError, match="^corrupt PNG: the first chunk is not IHDR$"):
        check_decodable(data)


def test_a_png_without_iend_is_truncated() -> None:
    with pytest.raises(ImageError, match="^truncated PNG$"):
        check_decodable(png(end=False))


def test_a_png_with_an_unknown_critical_chunk_is_refused_and_ancillary_chunks_pass() -> None:
    assert check_decodable(png(after_ihdr=[png_chunk(b"tEXt", b"a\x00b")])) == "image/png"
    with pytest.raises(ImageError, match="^PNG with the unknown critical chunk ABCD is not readable"):
        check_decodable(png(after_ihdr=[png_chunk(b"ABCD", b"")]))


def test_a_palette_png_without_its_palette_is_corrupt() -> None:
    with pytest.raises(ImageError, match="^corrupt PNG: palette image without PLTE$"):
        check_decodable(palette_png(with_plte=False))


def test_an_image_too_large_for_stb_image_is_refused() -> None:
    data = bytearray(png())
    struct.pack_into(">II", data, 16, 40_000, 40_000)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    with pytest.raises(ImageError, match="too large"):
        check_decodable(bytes(data))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_give_a_readable_type_or_an_image_error(data: bytes) -> None:
    try:
        assert check_decodable(data) in ACCEPTED
    except ImageError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(READABLE)), st.integers(min_value=0), st.binary(min_size=1, max_size=8))
def test_damaged_real_images_give_a_readable_type_or_an_image_error(
    name: str, where: int, garbage: bytes
) -> None:
    data = READABLE[name][0]()
    at = where % len(data)
    damaged = data[:at] + garbage + data[at + len(garbage) :]
    try:
        assert check_decodable(damaged) in ACCEPTED
    except ImageError:
        pass


def test_image_error_faults_like_a_failed_fetch() -> None:
    assert issubclass(ImageError, FetchError)


# --- data URLs --------------------------------------------------------------------------


def inline(messages: list[dict[str, object]]) -> list[dict[str, object]]:
    """A job whose images are all data URLs: planned and finished without fetches."""
    return finish_images(messages, plan_images(messages), {})


def decoded(url: str) -> bytes:
    """The bytes plan_images decodes from one data URL."""
    plan = plan_images([image_message(url)])
    assert plan.to_fetch == [] and list(plan.inline) == [(0, 1)]
    return plan.inline[(0, 1)]


def test_a_data_url_is_decoded_and_its_declared_type_kept_when_canonical() -> None:
    data = jpeg()
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    plan = plan_images([image_message(url)])
    assert plan.inline == {(0, 1): data}
    assert plan.canonical == {(0, 1): "image/jpeg"}


def test_data_url_parsing_is_case_insensitive_and_skips_parameters() -> None:
    url = "DATA:Image/PNG;charset=binary;BASE64," + base64.b64encode(b"\x89PNG").decode()
    assert decoded(url) == b"\x89PNG"
    assert plan_images([image_message(url)]).canonical == {}  # not as to_data_url writes it


def test_whitespace_and_line_breaks_in_the_base64_are_tolerated() -> None:
    data = png()
    text = base64.encodebytes(data).decode()  # MIME style: a line break every 76 characters
    assert "\n" in text
    assert decoded("data:image/png;base64,\r\n " + text) == data


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=1, max_size=200), st.lists(st.sampled_from(" \t\r\n\f\v"), max_size=6), st.data())
def test_base64_with_or_without_whitespace_decodes_to_the_same_bytes(
    data: bytes, spaces: list[str], draw: st.DataObject
) -> None:
    text = base64.b64encode(data).decode()
    for space in spaces:
        at = draw.draw(st.integers(0, len(text)))
        text = text[:at] + space + text[at:]
    assert decoded("data:image/png;base64," + text) == data


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (" data:image/jpeg;base64,QQ==", "not a data: URL"),
        ("data:image/jpeg;base64", "no comma"),
        ("data:image/jpeg,%FF%D8", "without ;base64"),
        ("data:image/jpeg;base64,/9j/4A*=", "invalid base64"),
        ("data:image/jpeg;base64,/9j/4A", "invalid base64"),  # missing padding
        ("data:image/jpeg;base64,/9j/4A==QQ==", "invalid base64"),  # data after padding
        ("data:image/jpeg;base64,/9j-_A==", "invalid base64"),  # URL-safe alphabet
        ("data:image/jpeg;base64,ÿØ==", "invalid base64"),
        ("data:image/jpeg;base64,", "empty image"),
        ("data:image jpeg;base64,QQ==", "media type"),
    ],
)
def test_malformed_data_urls_are_refused(url: str, message: str) -> None:
    with pytest.raises(ImageError, match=r"^messages\[0\]\.content\[1\]: .*" + message):
        plan_images([image_message(url)])


def test_an_error_never_quotes_the_data() -> None:
    url = "data:image/jpeg;base64,SECRETSECRET*"
    with pytest.raises(ImageError) as caught:
        plan_images([image_message(url)])
    assert "SECRET" not in str(caught.value)


def test_to_data_url_is_the_form_koboldcpp_reads() -> None:
    data = bytes(range(256)) * 100
    url = to_data_url("image/png", data)
    assert url.startswith("data:image/png;base64,")
    assert "\n" not in url
    assert base64.b64decode(url.split(",", 1)[1], validate=True) == data
    plan = plan_images([image_message(url)])
    assert plan.inline == {(0, 1): data} and plan.canonical == {(0, 1): "image/png"}


# --- image parts in messages ------------------------------------------------------------


def test_image_urls_lists_every_image_part_by_position() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        image_message("https://a.example/1.jpg", "data:image/png;base64,QQ=="),
        {"role": "assistant", "content": None},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://b/2"}}]},
    ]
    assert image_urls(messages) == [
        (1, 1, "https://a.example/1.jpg"),
        (1, 2, "data:image/png;base64,QQ=="),
        (3, 0, "https://b/2"),
    ]


def test_finished_messages_are_a_copy_keeping_every_other_key() -> None:
    messages = [image_message("https://a.example/1.jpg", to_data_url("image/png", png()))]
    before = copy.deepcopy(messages)
    plan = plan_images(messages)
    result = finish_images(messages, plan, {(0, 1): jpeg()})
    assert messages == before
    assert image_urls(result) == [(0, 1, to_data_url("image/jpeg", jpeg())), (0, 2, to_data_url("image/png", png()))]
    assert [p["image_url"]["detail"] for p in result[0]["content"][1:]] == ["auto", "auto"]
    result[0]["content"][0]["text"] = "changed"
    result[0]["content"][1]["image_url"]["url"] = "changed"
    assert messages == before


# --- caps -------------------------------------------------------------------------------


def padded(size: int) -> bytes:
    """A real JPEG of exactly ``size`` bytes: zero padding after its end is accepted."""
    data = jpeg()
    return data + bytes(size - len(data))


def test_the_caps() -> None:
    assert MAX_IMAGE_BYTES == 10 * MIB
    assert MAX_REQUEST_IMAGE_BYTES == 27 * MIB
    assert MAX_REQUEST_IMAGE_BYTES * 4 / 3 <= 36 * MIB  # as base64, within the body cap
    assert MAX_IMAGES == 16


def test_an_image_at_the_cap_passes_and_one_byte_more_is_refused() -> None:
    messages = [image_message("https://store.example/a", "https://store.example/b")]
    plan = plan_images(messages)
    finish_images(messages, plan, {(0, 1): jpeg(), (0, 2): padded(MAX_IMAGE_BYTES)})
    with pytest.raises(ImageError, match=r"^messages\[0\]\.content\[2\]: image of 10485761 bytes is over the cap"):
        finish_images(messages, plan, {(0, 1): jpeg(), (0, 2): padded(MAX_IMAGE_BYTES + 1)})


def test_images_at_the_job_total_pass_and_one_byte_more_is_refused() -> None:
    messages = [image_message(*["https://store.example/x"] * 3)]
    plan = plan_images(messages)
    finish_images(messages, plan, {(0, 1): padded(9 * MIB), (0, 2): padded(9 * MIB), (0, 3): padded(9 * MIB)})
    with pytest.raises(ImageError, match="^3 images of 28311553 bytes together are over the cap of 28311552 bytes per job$"):
        finish_images(messages, plan, {(0, 1): padded(9 * MIB), (0, 2): padded(9 * MIB), (0, 3): padded(9 * MIB + 1)})


def test_many_images_are_not_capped_by_number() -> None:
    messages = [image_message(*[to_data_url("image/png", png())] * 100)]
    assert len(image_urls(inline(messages))) == 100


# --- planning and finishing a job's images ---------------------------------------------


def test_a_base64_job_gets_its_images_checked_and_relabelled_by_their_bytes() -> None:
    jpeg_bytes, png_bytes = jpeg(), png()
    messages = [
        image_message(
            "data:image/jpeg;base64," + base64.b64encode(jpeg_bytes).decode(),
            "data:image/jpeg;base64," + base64.b64encode(png_bytes).decode(),  # mislabelled
        )
    ]
    before = copy.deepcopy(messages)
    result = inline(messages)
    assert messages == before
    assert image_urls(result) == [
        (0, 1, to_data_url("image/jpeg", jpeg_bytes)),
        (0, 2, to_data_url("image/png", png_bytes)),
    ]
    assert result[0]["content"][0] == {"type": "text", "text": "What is this?"}


def test_a_data_url_already_in_koboldcpps_form_is_passed_on_as_the_same_string() -> None:
    """No second copy of a large image: the string the job brought is the one sent."""
    jpeg_bytes, png_bytes = jpeg(), png()
    canonical = to_data_url("image/jpeg", jpeg_bytes)
    canonical_png = "data:image/png;base64," + base64.b64encode(png_bytes).decode()
    messages = [image_message(canonical, canonical_png)]
    plan = plan_images(messages)
    assert plan.canonical == {(0, 1): "image/jpeg", (0, 2): "image/png"}
    result = finish_images(messages, plan, {})
    assert result[0]["content"][1]["image_url"]["url"] is canonical
    assert result[0]["content"][2]["image_url"]["url"] is canonical_png
    assert result[0]["content"][1] is not messages[0]["content"][1]  # still a copy around it


@pytest.mark.parametrize(
    "head",
    [
        "data:image/png;base64,",  # labelled PNG, holds a JPEG: relabelled
        "DATA:image/jpeg;base64,",  # upper case
        "data:Image/JPEG;base64,",
        "data:image/jpeg;charset=binary;base64,",  # a parameter
        "data:image/jpeg; base64,",
        "data:image/jpg;base64,",  # not the sniffed type's name
    ],
)
def test_any_other_data_url_is_rebuilt_in_koboldcpps_form(head: str) -> None:
    data = jpeg()
    messages = [image_message(head + base64.b64encode(data).decode())]
    result = finish_images(messages, plan_images(messages), {})
    assert image_urls(result) == [(0, 1, to_data_url("image/jpeg", data))]


def test_a_data_url_with_line_breaks_is_rebuilt_without_them() -> None:
    data = jpeg()
    url = "data:image/jpeg;base64," + base64.encodebytes(data).decode()
    assert "\n" in url
    messages = [image_message(url)]
    plan = plan_images(messages)
    assert plan.canonical == {}
    assert image_urls(finish_images(messages, plan, {})) == [(0, 1, to_data_url("image/jpeg", data))]


def test_a_url_job_is_planned_fetched_and_finished_as_data_urls() -> None:
    jpeg_bytes, png_bytes = jpeg(), png()
    messages = [
        {"role": "system", "content": "Describe images."},
        image_message("https://store.example/a?X-Amz-Signature=s1"),
        {"role": "assistant", "content": "A pattern."},
        image_message("HTTP://store.example/b?sig=2", text="And this?"),
    ]
    before = copy.deepcopy(messages)
    plan = plan_images(messages)
    assert plan.to_fetch == [
        (1, 1, "https://store.example/a?X-Amz-Signature=s1"),
        (3, 1, "HTTP://store.example/b?sig=2"),
    ]
    assert plan.inline == {}
    result = finish_images(messages, plan, {(1, 1): jpeg_bytes, (3, 1): png_bytes})
    assert messages == before
    assert image_urls(result) == [
        (1, 1, to_data_url("image/jpeg", jpeg_bytes)),
        (3, 1, to_data_url("image/png", png_bytes)),
    ]
    assert [m["role"] for m in result] == ["system", "user", "assistant", "user"]


def test_a_job_without_images_is_returned_as_an_equal_copy() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    plan = plan_images(messages)
    assert plan == ImagePlan()
    result = finish_images(messages, plan, {})
    assert result == messages
    assert result is not messages


def test_a_fetched_webp_faults_the_job_naming_the_part_and_type_not_the_url() -> None:
    messages = [image_message("https://store.example/a?sig=SECRET")]
    plan = plan_images(messages)
    with pytest.raises(ImageError) as caught:
        finish_images(messages, plan, {(0, 1): webp()})
    assert str(caught.value) == "messages[0].content[1]: WebP image, not JPEG or PNG"


@pytest.mark.parametrize("name", list(FAULTED))
def test_an_inline_image_of_another_format_faults_the_job_and_is_not_relabelled(name: str) -> None:
    data = FAULTED[name][0]
    messages = [image_message(to_data_url("image/jpeg", jpeg()), to_data_url("image/jpeg", data))]
    with pytest.raises(ImageError) as caught:
        inline(messages)
    assert str(caught.value) == f"messages[0].content[2]: {name} image, not JPEG or PNG"


def test_a_truncated_fetched_image_faults_the_job() -> None:
    messages = [image_message("https://store.example/a")]
    plan = plan_images(messages)
    with pytest.raises(ImageError, match=r"^messages\[0\]\.content\[1\]: truncated JPEG$"):
        finish_images(messages, plan, {(0, 1): jpeg()[:-10]})


def test_an_image_that_was_not_fetched_faults_the_job() -> None:
    messages = [image_message("https://store.example/a")]
    with pytest.raises(ImageError, match=r"^messages\[0\]\.content\[1\]: image was not fetched$"):
        finish_images(messages, plan_images(messages), {})


def test_fetched_images_over_the_job_total_fault_the_job() -> None:
    messages = [image_message(*["https://store.example/x"] * 3)]
    plan = plan_images(messages)
    big = jpeg() + b"\x00" * (9 * MIB)  # 9 MiB each: per image fine, 27 MiB + 3 x jpeg in total
    with pytest.raises(ImageError, match="per job"):
        finish_images(messages, plan, {(0, 1): big, (0, 2): big, (0, 3): big})


def test_an_over_cap_inline_image_fails_at_planning_before_any_fetch() -> None:
    big = base64.b64encode(b"\xff\xd8\xff" + b"\x00" * MAX_IMAGE_BYTES).decode()
    messages = [image_message("https://store.example/x", "data:image/jpeg;base64," + big)]
    with pytest.raises(ImageError, match=r"^messages\[0\]\.content\[2\]: image of 10485763 bytes"):
        plan_images(messages)


def test_a_malformed_inline_image_fails_at_planning() -> None:
    messages = [image_message("data:image/jpeg;base64,@@@@")]
    with pytest.raises(ImageError, match=r"^messages\[0\]\.content\[1\]: invalid base64"):
        plan_images(messages)


@pytest.mark.parametrize("url", ["ftp://store.example/a.jpg", "file:///etc/passwd", "a.jpg"])
def test_image_urls_of_other_schemes_are_refused(url: str) -> None:
    with pytest.raises(ImageError, match="scheme"):
        plan_images([image_message(url)])


def test_more_images_than_koboldcpp_keeps_are_let_through_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = to_data_url("image/png", png())
    messages = [image_message(*[url] * (MAX_IMAGES + 1))]
    with caplog.at_level(logging.WARNING, logger="koboldcpp_horde_chat.images"):
        result = inline(messages)
    assert len(image_urls(result)) == MAX_IMAGES + 1
    assert "koboldcpp keeps only the last 16" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="koboldcpp_horde_chat.images"):
        inline([image_message(*[url] * MAX_IMAGES)])
    assert caplog.text == ""


def test_finish_refuses_a_plan_for_other_messages() -> None:
    messages = [image_message("https://store.example/a")]
    with pytest.raises(ValueError, match="do not match"):
        finish_images([image_message("https://a", "https://b")], plan_images(messages), {(0, 1): jpeg()})
    with pytest.raises(ValueError, match="do not match"):
        finish_images(messages, plan_images(messages), {(0, 1): jpeg(), (0, 2): jpeg()})
