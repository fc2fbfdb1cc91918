"""Request bodies encoded with large strings copied once (pure: no I/O).

A chat job with images carries them as base64 data URLs, up to 36 MiB of
conversation: ``json.dumps(body).encode()`` would hold the text twice more.
:func:`encode_json` writes the same bytes with each long string copied once.
Used for koboldcpp's ``/v1/chat/completions`` body, whose size is checked
against koboldcpp's ``--maxrequestsize`` before it is sent.

:func:`finite_number` is the one reading of a number from JSON the worker
did not write itself or may find damaged (the Horde's ``reward``,
koboldcpp's perf figures, the journal's times).
"""

from __future__ import annotations

import json
import math
import secrets
from typing import Any

RAW_STRING_MIN_CHARS = 64 * 1024
"""Strings of at least this many characters that need no JSON escaping are
spliced into an encoded body as they are (see :func:`encode_json`)."""

# Bytes a JSON string may hold unescaped, as json.dumps (ensure_ascii) writes them:
# printable ASCII but '"' and '\\'. Deleting these from a string's bytes leaves
# the ones that need escaping.
_UNESCAPED_JSON_BYTES = bytes(b for b in range(0x20, 0x7F) if b not in b'"\\')


def encode_json(body: Any) -> bytes | bytearray:
    """``json.dumps(body)`` as bytes, with large strings copied only once.

    The text is exactly ``json.dumps(body).encode("ascii")`` (``ensure_ascii``,
    default separators), e.g. ``{"a": [1, "x"]}`` -> ``b'{"a": [1, "x"]}'``.
    Strings of at least :data:`RAW_STRING_MIN_CHARS` characters that need no
    escaping (printable ASCII without ``"`` or ``\\``, such as a base64 image
    data URL) are swapped for a placeholder while ``json.dumps`` encodes the
    rest, then spliced in as they are: the answer is then one ``bytearray``
    holding each such string once, where ``json.dumps(...).encode()`` makes two
    full copies of a 36 MiB conversation. ``requests`` sends either with a
    ``Content-Length``, and urllib3 2.x sends a ``bytearray`` as one buffer.

    Args:
        body: a JSON value: dicts, lists, tuples, strings, numbers, booleans, None.

    Returns:
        The encoded body: ``bytes`` when no string was spliced, else a ``bytearray``.

    Raises:
        TypeError, ValueError: as ``json.dumps`` for a value it cannot encode.
        RecursionError: a value nested too deeply, or one that contains itself.
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
    """Write ``value`` as a JSON string into ``out`` at ``pos`` (room is made for
    ``len(value) + 2`` bytes); returns the position after it.

    ``value`` is ASCII without ``"`` or ``\\``; when it holds a control
    character after all, its escaped form replaces the room made for it.
    """
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
    """``value`` with every long ASCII string without ``"`` or ``\\`` replaced by ``marker``.

    The strings are appended to ``raws`` in the order ``json.dumps`` writes them
    (dicts in insertion order, lists in order). Containers are copied only on
    the path to a replaced string; the input is not modified.
    """
    if isinstance(value, str):
        if (
            len(value) >= RAW_STRING_MIN_CHARS
            and value.isascii()
            and '"' not in value
            and "\\" not in value
        ):
            raws.append(value)
            return marker
        return value
    if isinstance(value, dict):
        copied: dict[Any, Any] | None = None
        for key, item in value.items():
            if isinstance(item, str | dict | list | tuple):
                swapped = _swap_long_strings(item, raws, marker)
                if swapped is not item:
                    if copied is None:
                        copied = dict(value)
                    copied[key] = swapped
        return value if copied is None else copied
    if isinstance(value, list | tuple):
        items: list[Any] | None = None
        for index, item in enumerate(value):
            if isinstance(item, str | dict | list | tuple):
                swapped = _swap_long_strings(item, raws, marker)
                if swapped is not item:
                    if items is None:
                        items = list(value)
                    items[index] = swapped
        return value if items is None else items
    return value


def finite_number(value: object) -> float | None:
    """``value`` as a float when it is a finite JSON number, else None: a boolean,
    a string, NaN, an infinity (Python's ``json`` reads ``Infinity``) and an
    integer too large for a float (JSON's integers have no bound) are not."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None
