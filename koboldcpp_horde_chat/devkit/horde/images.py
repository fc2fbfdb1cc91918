"""Images (seed 004) and the object store: checking and storing a request's images,
offloaded messages, signed URLs and the storage port that serves them.
"""

from __future__ import annotations

import base64
import binascii
import copy
import gzip
import hashlib
import hmac
import http.client
import time
import uuid
from collections.abc import Iterable
from typing import Any
from urllib.parse import urljoin, urlsplit

from koboldcpp_horde_chat.devkit._http import Request, Response
from koboldcpp_horde_chat.devkit.horde.dispatch import Dispatch
from koboldcpp_horde_chat.devkit.horde.helpers import _compact, log
from koboldcpp_horde_chat.devkit.horde.state import _ChatSpec
from koboldcpp_horde_chat.devkit.horde.values import (
    _IMAGE_MARK,
    IMAGE_FETCH_REDIRECTS,
    IMAGE_FETCH_TIMEOUT_S,
    MAX_IMAGE_BYTES,
    MAX_IMAGE_SIDE,
    MAX_REQUEST_IMAGE_BYTES,
    MIN_IMAGE_URL_S,
)

_JPEG_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """``(width, height)`` in pixels from a JPEG's frame header, or None when ``data``
    is not a JPEG (no ``FF D8 FF`` start) or no frame header precedes the first scan."""
    if data[:3] != b"\xff\xd8\xff":
        return None
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # no length field
            pos += 2
            continue
        if marker in (0xD9, 0xDA):  # EOI or a scan before any frame header
            return None
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        if length < 2:
            return None
        if marker in _JPEG_SOF_MARKERS:
            if pos + 9 > len(data) or length < 7:
                return None
            height = int.from_bytes(data[pos + 5 : pos + 7], "big")
            width = int.from_bytes(data[pos + 7 : pos + 9], "big")
            return width, height
        pos += 2 + length
    return None


def _storable_jpeg(data: bytes) -> bool:
    size = jpeg_size(data)
    return size is not None and 0 < max(size) <= MAX_IMAGE_SIDE and min(size) > 0


def _fetch_local_image(url: str, cap: int) -> bytes:
    """GET an http(s) image URL on 127.0.0.1 (at most 3 redirects, at most ``cap``
    bytes). Raises ``ValueError`` for another host, a failure or an oversized body."""
    for _ in range(IMAGE_FETCH_REDIRECTS + 1):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or parts.hostname != "127.0.0.1":
            raise ValueError("the dev Horde fetches image URLs from 127.0.0.1 only")
        conn_cls = (
            http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        )
        conn = conn_cls("127.0.0.1", parts.port, timeout=IMAGE_FETCH_TIMEOUT_S)
        try:
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn.request("GET", target, headers={"Accept": "image/*"})
            resp = conn.getresponse()
            if resp.status in (301, 302, 303, 307, 308):
                location = resp.getheader("Location")
                if not location:
                    raise ValueError(f"image URL redirect {resp.status} without Location")
                url = urljoin(url, location)
                continue
            if resp.status != 200:
                raise ValueError(f"image URL answered HTTP {resp.status}")
            data = resp.read(cap + 1)
        except (OSError, http.client.HTTPException) as exc:
            raise ValueError(f"image URL could not be fetched: {exc}") from None
        finally:
            conn.close()
        if len(data) > cap:
            raise ValueError(f"an image is over the cap of {cap} bytes")
        return data
    raise ValueError(f"image URL redirected more than {IMAGE_FETCH_REDIRECTS} times")


def _parse_data_url(url: str) -> tuple[str, bytes] | None:
    """``data:<type>;base64,<data>`` -> (media type, bytes), or None when not one."""
    if not url.startswith("data:") or "," not in url:
        return None
    head, _, data = url[5:].partition(",")
    if not head.endswith(";base64"):
        return None
    try:
        return head[: -len(";base64")] or "application/octet-stream", base64.b64decode(
            data, validate=True
        )
    except (binascii.Error, ValueError):
        return None


def _image_parts(messages: list[dict[str, Any]]) -> Iterable[dict[str, Any]]:
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image_url":
                    yield part


def _part_url(part: dict[str, Any]) -> str:
    image = part.get("image_url")
    if isinstance(image, dict):
        return str(image.get("url", ""))
    return str(image or "")


def _set_part_url(part: dict[str, Any], url: str) -> None:
    image = part.get("image_url")
    if isinstance(image, dict):
        image["url"] = url
    else:
        part["image_url"] = {"url": url}


class ObjectStore(Dispatch):
    """The storage port: stored images, offloaded messages and their signed URLs."""

    @property
    def storage_url(self) -> str:
        """The storage port's base URL."""
        if not self._storage.running and self._storage._port:  # during refuse_connections()
            return f"http://{self._storage._host}:{self._storage._port}"
        return self._storage.url

    def stored_images(self, request_id: str) -> list[bytes]:
        """The JPEG bytes stored for a chat request's images, in message order.

        Raises ``KeyError`` for an unknown request id.
        """
        with self._lock:
            return [self._objects[key][0] for key in self._image_keys(request_id)]

    def replace_stored_image(self, request_id: str, index: int, data: bytes) -> None:
        """A test hook: swap the stored bytes of a request's ``index``-th image (from 0).

        Simulates a storage object that is not what the Horde stored (a WebP, an
        object over the caps, a damaged file). Later signed URLs and base64
        payloads serve ``data``; messages already offloaded keep their copy.
        Raises ``KeyError`` for an unknown request and ``IndexError`` for an
        unknown image.
        """
        with self._lock:
            key = self._image_keys(request_id)[index]
            self._objects[key] = (bytes(data), dict(self._objects[key][1]))

    def _store_images(self, spec: _ChatSpec) -> None:
        """Seed 004 at submit: check, convert to JPEG, store each image and mark its part.

        Every image is checked before any is stored. Raises ``ValueError`` for a
        URL that is neither a base64 data URL nor http(s) on 127.0.0.1, a failed
        fetch, an image over the caps, or one that is not a JPEG of longest side
        at most 2048 when no ``image_converter`` is set (or the converter does not
        return one).
        """
        parts = list(_image_parts(spec.messages))
        sent: list[bytes] = []
        stored: list[bytes] = []
        for k, part in enumerate(parts):
            url = _part_url(part)
            scheme = url.split(":", 1)[0].lower()
            if scheme == "data":
                parsed = _parse_data_url(url)
                if parsed is None:
                    raise ValueError(f"image {k + 1}: not a base64 data URL")
                media_type, data = parsed
            elif scheme in ("http", "https"):
                media_type, data = "", _fetch_local_image(url, MAX_IMAGE_BYTES)
            else:
                raise ValueError(f"image {k + 1}: the url must be a data URL or http(s)")
            sent.append(data)
            if _storable_jpeg(data):
                jpeg = data
            elif self.image_converter is None:
                raise ValueError(
                    f"image {k + 1}: the dev Horde stores JPEGs of longest side at most "
                    f"{MAX_IMAGE_SIDE} as sent and needs an image_converter for the rest"
                )
            else:
                jpeg = self.image_converter(data, media_type)
                if not _storable_jpeg(jpeg):
                    raise ValueError(
                        f"image {k + 1}: the image_converter did not return a JPEG of "
                        f"longest side at most {MAX_IMAGE_SIDE}"
                    )
            stored.append(jpeg)
        for what, images in (("sent", sent), ("stored", stored)):
            for k, data in enumerate(images):
                if len(data) > MAX_IMAGE_BYTES:
                    raise ValueError(
                        f"image {k + 1} ({what}) is over the cap of {MAX_IMAGE_BYTES} bytes"
                    )
            if sum(len(d) for d in images) > MAX_REQUEST_IMAGE_BYTES:
                raise ValueError(
                    f"the images ({what}) are over the cap of {MAX_REQUEST_IMAGE_BYTES} "
                    "bytes per request"
                )
        for part, jpeg in zip(parts, stored, strict=True):
            key = f"img-{uuid.uuid4().hex}"
            with self._lock:
                self._objects[key] = (jpeg, {"Content-Type": "application/octet-stream"})
            _set_part_url(part, _IMAGE_MARK + key)

    def _image_keys(self, request_id: str) -> list[str]:
        spec = self._requests[request_id].chat
        if spec is None:
            return []
        return [
            _part_url(part)[len(_IMAGE_MARK) :]
            for part in _image_parts(spec.messages)
            if _part_url(part).startswith(_IMAGE_MARK)
        ]

    def _inline_images(
        self, messages: list[dict[str, Any]], transport: str
    ) -> list[dict[str, Any]]:
        """A copy of ``messages`` with each stored image as a data URL or a signed URL."""
        out = copy.deepcopy(messages)
        for part in _image_parts(out):
            url = _part_url(part)
            if not url.startswith(_IMAGE_MARK):
                continue
            key = url[len(_IMAGE_MARK) :]
            if transport == "url":
                lifetime = self.image_url_s
                if lifetime is None:
                    lifetime = max(self.ttl_s, MIN_IMAGE_URL_S)
                _set_part_url(part, self._sign(key, lifetime))
            else:
                data = self._objects[key][0]
                _set_part_url(
                    part, "data:image/jpeg;base64," + base64.b64encode(data).decode("ascii")
                )
        return out

    def _maybe_offload(self, spec: _ChatSpec) -> None:
        if self.offload_bytes is None:
            return
        inline = self._inline_images(spec.messages, "base64")
        raw = _compact(inline)
        if len(raw) <= self.offload_bytes:
            return
        headers = {"Content-Type": "application/json"}
        data = raw
        if self.offload_gzip:
            packed = gzip.compress(raw)
            if len(packed) < len(raw):
                data = packed
                headers["Content-Encoding"] = "gzip"
        key = f"msg-{uuid.uuid4().hex}"
        with self._lock:
            self._objects[key] = (data, headers)
        spec.offload_key = key

    def _sign(self, key: str, lifetime_s: float) -> str:
        exp = f"{time.time() + lifetime_s:.3f}"
        sig = hmac.new(self._secret, f"{key}:{exp}".encode(), hashlib.sha256).hexdigest()
        return f"{self.storage_url}/o/{key}?exp={exp}&sig={sig}"

    def _serve_storage(self, req: Request) -> Response:
        self._log_request("storage", req)

        def serve() -> Response:
            return self._storage_get(req)

        def on_scripted(script: Any) -> None:
            log.info("dev storage: scripted answer %r on %s", script, req.path)

        return self._scripted("storage", serve, on_scripted)

    def _storage_get(self, req: Request) -> Response:
        if req.method not in ("GET", "HEAD"):
            return Response.json(405, {"message": "Use GET.", "rc": "MethodNotAllowed"})
        parts = [p for p in req.path.split("/") if p]
        if len(parts) != 2 or parts[0] != "o":
            return Response.json(404, {"message": "No such object.", "rc": "NoSuchKey"})
        key = parts[1]
        exp = req.query_value("exp") or ""
        sig = req.query_value("sig") or ""
        want = hmac.new(self._secret, f"{key}:{exp}".encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, sig):
            return Response.json(403, {"message": "Bad signature.", "rc": "SignatureDoesNotMatch"})
        try:
            expired = float(exp) < time.time()
        except ValueError:
            expired = True
        if expired:
            return Response.json(403, {"message": "The URL has expired.", "rc": "AccessDenied"})
        with self._lock:
            obj = self._objects.get(key)
        if obj is None:
            return Response.json(404, {"message": "No such object.", "rc": "NoSuchKey"})
        data, headers = obj
        return Response(200, data, dict(headers))
