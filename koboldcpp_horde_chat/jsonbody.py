"""JSON bodies encoded with large strings copied once, and numbers read from JSON the
worker did not write (pure: no I/O).
"""

from __future__ import annotations

import json
import math
import secrets
from typing import Any

#: Strings this long that need no JSON escaping are spliced in as they are.
RAW_STRING_MIN_CHARS = 64 * 1024

# Bytes a JSON string may hold unescaped, as json.dumps (ensure_ascii) writes them:
# printable ASCII but '"' and '\\'. Deleting these from a string's bytes leaves
# the ones that need escaping.
_UNESCAPED_JSON_BYTES = bytes(b for b in range(0x20, 0x7F) if b not in b'"\\')


def encode_json(body: Any) -> bytes | bytearray:
    """Exactly ``json.dumps(body).encode("ascii")``, holding each long string (a base64
    image, say) once where that makes two more copies of a 36 MiB conversation:
    a ``bytearray`` when a string was spliced in, else ``bytes``.

    Raises as ``json.dumps`` does (TypeError, ValueError, RecursionError).
    """
    raws: list[str] = []
    marker = f"\x00{secrets.token_hex(16)}\x00"
    skeleton = _swap_long_strings(body, raws, marker)
    text = json.dumps(skeleton).encode("ascii")
    if not raws:
        return text
    pieces = text.split(json.dumps(marker).encode("ascii"))
    del text
    if len(pieces) != len(raws) + 1:  # cannot happen: the marker is random
        return json.dumps(body).encode("ascii")
    # One buffer of the final size (it never grows, so it is never copied), filled
    # 256 KiB at a time: no second whole copy of a long string is ever made.
    out = bytearray(sum(map(len, pieces)) + sum(len(value) + 2 for value in raws))
    out[: len(pieces[0])] = pieces[0]
    pos = len(pieces[0])
    for value, piece in zip(raws, pieces[1:], strict=True):
        pos = _splice_string(out, pos, value)
        out[pos : pos + len(piece)] = piece
        pos += len(piece)
    return out


_SPLICE_CHARS = 256 * 1024


def _splice_string(out: bytearray, pos: int, value: str) -> int:
    """Write ``value`` as a JSON string into the room made for it at ``pos``; the
    position after it (a control character found: its escaped form instead)."""
    start = pos
    out[pos] = 0x22  # '"'
    pos += 1
    for offset in range(0, len(value), _SPLICE_CHARS):
        chunk = value[offset : offset + _SPLICE_CHARS].encode("ascii")
        if chunk.translate(None, _UNESCAPED_JSON_BYTES):  # a control character
            escaped = json.dumps(value).encode("ascii")
            out[start : start + len(value) + 2] = escaped
            return start + len(escaped)
        out[pos : pos + len(chunk)] = chunk
        pos += len(chunk)
    out[pos] = 0x22
    return pos + 1


def _swap_long_strings(value: Any, raws: list[str], marker: str) -> Any:
    """``value`` with every long string needing no escaping replaced by ``marker`` and
    appended to ``raws`` in ``json.dumps``'s order; only containers on the path to
    one are copied."""
    if isinstance(value, str):
        long_ascii = len(value) >= RAW_STRING_MIN_CHARS and value.isascii()
        if long_ascii and '"' not in value and "\\" not in value:
            raws.append(value)
            return marker
        return value
    if isinstance(value, dict | list | tuple):
        pairs = value.items() if isinstance(value, dict) else enumerate(value)
        copied: Any = None  # a dict, or a list (also for a tuple)
        for key, item in pairs:
            if isinstance(item, str | dict | list | tuple):
                swapped = _swap_long_strings(item, raws, marker)
                if swapped is not item:
                    if copied is None:
                        copied = dict(value) if isinstance(value, dict) else list(value)
                    copied[key] = swapped
        return value if copied is None else copied
    return value


def finite_number(value: object) -> float | None:
    """``value`` as a float when it is a finite number (not a boolean, NaN, an
    infinity or an integer too large for a float), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None
