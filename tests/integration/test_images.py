"""Images end to end: the dev Horde, the real worker and the scripted koboldcpp.

Seed 000 step 5 ("Serve images") and step 7 ("A failed fetch is a fault too,
sent without fault_reason"), seed 004 (images stored as JPEG, longest side at
most 2048; a signed URL valid for the job's TTL and at least 600 s for a worker
declaring ``url``; a ``data:image/jpeg;base64,`` URL for one declaring only
``base64``; images inline in offloaded messages; no image request for a worker
without ``vision`` and a transport). koboldcpp reads only ``data:`` image URLs
and silently drops what it cannot decode, so every image must reach it as a data
URL of the exact bytes the Horde stored, or the job must fault; an image that is
not a JPEG or PNG (which a conforming Horde never sends) faults the job.

The images are real files built with the standard library (the unit tests'
encoders).
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import requests

from koboldcpp_horde_chat.devkit._http import JSONServer, Request, Response
from koboldcpp_horde_chat.devkit.horde import (
    MAX_IMAGE_BYTES,
    MAX_REQUEST_IMAGE_BYTES,
    DevHorde,
    jpeg_size,
)
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp
from koboldcpp_horde_chat.horde.declaration import BackendCapabilities
from koboldcpp_horde_chat.hosts.hosting import run_worker
from koboldcpp_horde_chat.settings import WorkerSettings
from koboldcpp_horde_chat.state.shared import WorkerState

from ..unit.test_images import gif, jpeg, png, webp
from .conftest import API_KEY

MODEL = "koboldcpp/scripted-model"
VISION = [{"vision": True}]
PHOTO = jpeg(24, 16)
OTHER_PHOTO = jpeg(16, 24, progressive=True)


def data_url(media_type: str, data: bytes) -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode("ascii")


def image_request(*urls: str, text: str = "What is in this picture?", **extra: Any) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url, "detail": "auto"}} for url in urls]
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 64, **extra}


def to_jpeg(data: bytes, media_type: str) -> bytes:
    """A test image converter: every image becomes OTHER_PHOTO (the Horde's re-encoding)."""
    return OTHER_PHOTO


# --- running the worker ---------------------------------------------------------------------


@pytest.fixture
def start_base64_worker(horde: DevHorde, kcpp: ScriptedKoboldcpp) -> Iterator[Callable[[], Callable[[], None]]]:
    """The real worker declaring only ``base64`` (as koboldcpp's own embedded worker does).

    The CLI always declares ``url`` beside ``base64`` with vision, and the Horde
    prefers ``url``; this runs the same pop loop (``hosting.run_worker``) with the
    url transport off. Returns a function that stops it.
    """
    threads: list[tuple[threading.Thread, threading.Event]] = []

    def start() -> Callable[[], None]:
        settings = WorkerSettings(
            api_key=API_KEY,
            worker_name="test-worker",
            model_id=MODEL,
            backend_max_context_length=kcpp.max_context_length,
            max_length=512,
            horde_url=horde.url,
            kcpp_url=kcpp.url,
            vision=True,
            image_url_transport=False,
            local_idle_s=0.0,
        )
        stop = threading.Event()
        caps = BackendCapabilities(vision=True, image_url=False)
        thread = threading.Thread(
            target=run_worker, args=(settings,), kwargs={"state": WorkerState(settings, stop_event=stop), "caps": caps}, daemon=True
        )
        thread.start()
        threads.append((thread, stop))

        def halt() -> None:
            stop.set()
            thread.join(15)
            assert not thread.is_alive(), "the worker did not stop"

        return halt

    yield start
    for thread, stop in threads:
        stop.set()
        thread.join(15)


def serve(
    horde: DevHorde,
    start: Callable[[], Any],
    ids: list[str],
    timeout_s: float = 20,
) -> None:
    """Run a worker (``start()`` returns a RunningWorker or a stop function) until ``ids`` end."""
    worker = start()
    try:
        assert horde.wait(ids, timeout_s=timeout_s), [horde.status(i) for i in ids]
    finally:
        worker() if callable(worker) else worker.stop()


@pytest.fixture
def run_transport(
    request: pytest.FixtureRequest, start_worker: Any, start_base64_worker: Any
) -> Callable[[], Any]:
    """Start the worker for the transport named by ``transport`` (a test parameter)."""
    transport = request.node.callspec.params["transport"]
    return start_worker if transport == "url" else start_base64_worker


# --- what the tests check -------------------------------------------------------------------


def chat_bodies(kcpp: ScriptedKoboldcpp) -> list[dict[str, Any]]:
    return [r["body"] for r in kcpp.requests if r["path"] == "/v1/chat/completions"]


def tokencount_bodies(kcpp: ScriptedKoboldcpp) -> list[dict[str, Any]]:
    return [r["body"] for r in kcpp.requests if r["path"] == "/api/extra/tokencount"]


def popped_image_urls(horde: DevHorde) -> list[str]:
    urls = []
    for pop in horde.pops:
        payload = (pop["response"] or {}).get("payload") or {}
        for message in payload.get("messages") or []:
            content = message.get("content")
            for part in content if isinstance(content, list) else []:
                if part.get("type") == "image_url":
                    urls.append(part["image_url"]["url"])
    return urls


def storage_requests(horde: DevHorde) -> list[dict[str, Any]]:
    return [r for r in horde.requests_log if r["port"] == "storage"]


def assert_no_credentials_reached_storage(horde: DevHorde) -> None:
    for r in storage_requests(horde):
        assert "apikey" not in r["headers"] and "authorization" not in r["headers"], r["headers"]
        seen = " ".join([r["path"], r["query"], *r["headers"].values()]).encode() + r["body"]
        assert API_KEY.encode() not in seen


def the_single_fault_without_reason(horde: DevHorde, rid: str) -> None:
    """The request ended faulted by one faulted submit without fault_reason, nothing else."""
    status = horde.status(rid)
    assert status["faulted"] and status["fault_reasons"] == [] and status["return_code"] is None
    (entry,) = horde.ledger
    assert entry["action"] == "faulted" and entry["status"] == 200
    assert entry["body"] == {"id": entry["job_id"], "state": "faulted", "model_id": MODEL}


def assert_reached_koboldcpp_as_stored(horde: DevHorde, kcpp: ScriptedKoboldcpp, rid: str) -> None:
    stored = horde.stored_images(rid)
    (received,) = kcpp.images
    assert received["data_urls"] == [data_url("image/jpeg", d) for d in stored]
    assert received["decoded"] == stored
    assert received["dropped"] == []
    (entry,) = horde.ledger
    assert entry["action"] == "submitted" and entry["body"]["message"]["content"] == (
        f"I see {len(stored)} image{'s' if len(stored) > 1 else ''}."
    )


# --- delivery by transport --------------------------------------------------------------------


@pytest.mark.parametrize("kcpp", VISION, indirect=True)
@pytest.mark.parametrize("horde", [{"image_converter": to_jpeg}], indirect=True)
def test_a_url_transport_job_reaches_koboldcpp_as_a_jpeg_data_url_of_the_stored_bytes(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    # A PNG is stored as the converter's JPEG, and a JPEG as sent: koboldcpp gets the stored bytes.
    rid = horde.send_chat(image_request(data_url("image/png", png(5, 4)), data_url("image/jpeg", PHOTO)))
    assert horde.stored_images(rid) == [OTHER_PHOTO, PHOTO]
    sent_at = time.time()
    serve(horde, start_worker, [rid])
    (pop,) = [p for p in horde.pops if p["response"].get("id")]
    assert pop["body"]["image_transports"] == ["messages_url", "base64", "url"]
    assert "vision" in pop["body"]["chat_features"]
    urls = popped_image_urls(horde)
    assert len(urls) == 2
    for url in urls:
        assert url.startswith(horde.storage_url + "/o/")
        query = parse_qs(urlsplit(url).query)
        assert float(query["exp"][0]) - sent_at >= 600 - 1  # max(ttl 150, 600) seconds
    fetched = sorted(urlsplit(u).path for u in urls)
    assert sorted(r["path"] for r in storage_requests(horde)) == fetched  # each fetched once
    assert_reached_koboldcpp_as_stored(horde, kcpp, rid)
    (body,) = chat_bodies(kcpp)
    images = [p["image_url"] for p in body["messages"][0]["content"] if p["type"] == "image_url"]
    assert [i["detail"] for i in images] == ["auto", "auto"]  # other keys of the part are kept
    assert_no_credentials_reached_storage(horde)


@pytest.mark.parametrize("kcpp", VISION, indirect=True)
def test_a_base64_job_reaches_koboldcpp_as_a_jpeg_data_url_of_the_stored_bytes(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_base64_worker: Any
) -> None:
    rid = horde.send_chat(image_request(data_url("image/jpeg", PHOTO)))
    serve(horde, start_base64_worker, [rid])
    (pop,) = [p for p in horde.pops if p["response"].get("id")]
    assert pop["body"]["image_transports"] == ["messages_url", "base64"]
    assert popped_image_urls(horde) == [data_url("image/jpeg", PHOTO)]
    assert storage_requests(horde) == []
    assert_reached_koboldcpp_as_stored(horde, kcpp, rid)


@pytest.mark.parametrize("gzipped", [False, True])
@pytest.mark.parametrize("kcpp", VISION, indirect=True)
def test_an_offloaded_request_with_inlined_images_is_served(
    kcpp: ScriptedKoboldcpp, start_worker: Any, horde: DevHorde, gzipped: bool
) -> None:
    horde.offload_bytes = 1000
    horde.offload_gzip = gzipped
    rid = horde.send_chat(image_request(data_url("image/jpeg", PHOTO), data_url("image/jpeg", OTHER_PHOTO)))
    serve(horde, start_worker, [rid])
    (pop,) = [p for p in horde.pops if p["response"].get("id")]
    payload = pop["response"]["payload"]
    assert "messages" not in payload and payload["messages_url"].startswith(horde.storage_url)
    (fetch,) = storage_requests(horde)  # one fetch: the images came inline in the messages
    assert fetch["path"] == urlsplit(payload["messages_url"]).path
    assert_reached_koboldcpp_as_stored(horde, kcpp, rid)
    assert_no_credentials_reached_storage(horde)


@pytest.mark.parametrize("kcpp", VISION, indirect=True)
def test_the_api_key_never_reaches_the_storage_port(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    ids = [horde.send_chat(image_request(data_url("image/jpeg", PHOTO))) for _ in range(2)]
    horde.offload_bytes = 500
    ids.append(horde.send_chat(image_request(data_url("image/jpeg", PHOTO))))  # offloaded
    serve(horde, start_worker, ids)
    assert all(horde.status(i)["done"] for i in ids)
    assert len(storage_requests(horde)) == 3  # two image URLs and one messages URL
    assert_no_credentials_reached_storage(horde)
    horde_calls = [r for r in horde.requests_log if r["port"] == "horde"]
    assert horde_calls and all(r["headers"].get("apikey") == API_KEY for r in horde_calls)


# --- images that cannot be served: a fault without reason --------------------------------------


@pytest.mark.parametrize("kcpp", VISION, indirect=True)
@pytest.mark.parametrize("horde", [{"image_url_s": -1}], indirect=True)
def test_an_expired_signed_url_faults_the_job_without_a_reason(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    rid = horde.send_chat(image_request(data_url("image/jpeg", PHOTO)), max_attempts=1)
    serve(horde, start_worker, [rid])
    (url,) = popped_image_urls(horde)
    assert requests.get(url, timeout=5).status_code == 403
    assert len(storage_requests(horde)) == 2  # the worker tried once (and we once)
    the_single_fault_without_reason(horde, rid)
    assert chat_bodies(kcpp) == [] and kcpp.images == []
    assert_no_credentials_reached_storage(horde)


@pytest.mark.parametrize("transport", ["url", "base64"])
@pytest.mark.parametrize("kcpp", VISION, indirect=True)
@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(PHOTO[: len(PHOTO) // 2], id="truncated"),
        pytest.param(PHOTO + b"\x00" * (MAX_IMAGE_BYTES + 1 - len(PHOTO)), id="over-cap"),
    ],
)
def test_an_image_koboldcpp_cannot_use_faults_the_job_without_a_reason(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, run_transport: Any, transport: str, bad: bytes
) -> None:
    rid = horde.send_chat(image_request(data_url("image/jpeg", PHOTO)), max_attempts=1)
    horde.replace_stored_image(rid, 0, bad)
    serve(horde, run_transport, [rid])
    the_single_fault_without_reason(horde, rid)
    assert chat_bodies(kcpp) == [] and kcpp.images == []
    assert tokencount_bodies(kcpp) == []  # faulted before the fit check
    assert_no_credentials_reached_storage(horde)


@pytest.mark.parametrize("transport", ["url", "base64"])
@pytest.mark.parametrize("kcpp", VISION, indirect=True)
@pytest.mark.parametrize(("bad", "name"), [(gif(), "GIF"), (webp(), "WebP")], ids=["gif", "webp"])
def test_a_gif_or_webp_image_faults_the_job_naming_its_type_and_never_reaches_koboldcpp(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    run_transport: Any,
    transport: str,
    bad: bytes,
    name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Seed 004: the Horde sends only the JPEG it stored, so any other type is a
    fault without fault_reason, logged by its sniffed type, and no chat request."""
    caplog.set_level(logging.INFO)
    rid = horde.send_chat(
        image_request(data_url("image/jpeg", PHOTO), data_url("image/jpeg", OTHER_PHOTO)), max_attempts=1
    )
    horde.replace_stored_image(rid, 1, bad)  # the second image is not what a Horde stores
    serve(horde, run_transport, [rid])
    the_single_fault_without_reason(horde, rid)
    assert chat_bodies(kcpp) == [] and kcpp.images == []
    (entry,) = horde.ledger
    faults = [r.getMessage() for r in caplog.records if "kind=chat faulted" in r.getMessage()]
    assert faults == [
        f"job={entry['job_id']} kind=chat faulted: image unusable: "
        f"messages[0].content[2]: {name} image, not JPEG or PNG"
    ]


@pytest.mark.parametrize("kcpp", VISION, indirect=True)
def test_a_truncated_transfer_from_storage_faults_the_job_without_a_reason(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    rid = horde.send_chat(image_request(data_url("image/jpeg", PHOTO)), max_attempts=1)
    horde.inject("storage", "truncate")  # a well-formed answer carrying half the object
    serve(horde, start_worker, [rid])
    assert len(storage_requests(horde)) == 1
    the_single_fault_without_reason(horde, rid)
    assert chat_bodies(kcpp) == []


@pytest.mark.parametrize("kcpp", VISION, indirect=True)
def test_images_over_the_request_cap_together_fault_the_job(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    big = PHOTO + b"\x00" * (MAX_IMAGE_BYTES - len(PHOTO))  # each at the per-image cap
    count = MAX_REQUEST_IMAGE_BYTES // MAX_IMAGE_BYTES + 1
    rid = horde.send_chat(image_request(*[data_url("image/jpeg", PHOTO)] * count), max_attempts=1)
    for k in range(count):
        horde.replace_stored_image(rid, k, big)
    serve(horde, start_worker, [rid])
    the_single_fault_without_reason(horde, rid)
    assert chat_bodies(kcpp) == []


# --- eligibility and the fit check --------------------------------------------------------------


def test_a_request_with_images_never_reaches_a_worker_without_vision(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    image_rid = horde.send_chat(image_request(data_url("image/jpeg", PHOTO)), best_effort=True)
    text_rids = [
        horde.send_chat({"messages": [{"role": "user", "content": f"Name colour {k}."}]}, best_effort=True)
        for k in range(2)
    ]
    serve(horde, start_worker, text_rids)
    assert all(horde.status(r)["done"] for r in text_rids)
    status = horde.status(image_rid)
    assert status["state"] == "waiting" and status["job_ids"] == []
    assert all(p["body"]["image_transports"] == ["messages_url"] for p in horde.pops)
    assert all("vision" not in p["body"]["chat_features"] for p in horde.pops)
    assert kcpp.images == [] and storage_requests(horde) == []


def test_an_image_job_sent_to_a_worker_without_vision_is_faulted_without_a_reason(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    # A Horde bug: the job reaches a worker that did not declare vision.
    rid = horde.send_chat({"messages": [{"role": "user", "content": "hi"}]})
    messages = image_request(data_url("image/jpeg", PHOTO))["messages"]
    job = {
        "id": "image-job-1",
        "ids": ["image-job-1"],
        "chat": True,
        "payload": {"messages": messages, "max_length": 16, "max_context_length": 1024},
        "model": MODEL,
        "ttl": 150,
    }
    horde.inject("pop", (200, job))
    serve(horde, start_worker, [rid])
    submits = [r for r in horde.requests_log if r["path"].endswith("/submit") and b"image-job-1" in r["body"]]
    assert len(submits) == 1
    assert json.loads(submits[0]["body"]) == {"id": "image-job-1", "state": "faulted", "model_id": MODEL}
    assert kcpp.images == [] and all(b.get("messages") != messages for b in chat_bodies(kcpp))


@pytest.mark.parametrize("kcpp", VISION, indirect=True)
def test_the_fit_check_counts_512_tokens_per_image_and_never_sends_image_bytes_to_tokencount(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    urls = [data_url("image/jpeg", PHOTO), data_url("image/jpeg", OTHER_PHOTO)]
    max_tokens = 64
    worker = start_worker()
    try:
        first = horde.send_chat(image_request(*urls, max_tokens=max_tokens), best_effort=True)
        assert horde.wait(first, timeout_s=20) and horde.status(first)["done"]
        (counted_body,) = tokencount_bodies(kcpp)
        counted = requests.post(kcpp.url + "/api/extra/tokencount", json=counted_body, timeout=5).json()["value"]
        # counted tokens + 32 + 16 per message + 512 per image + max_length must fit the context
        needed = counted + 32 + 16 * 1 + 512 * 2 + max_tokens
        fits = horde.send_chat(
            image_request(*urls, max_tokens=max_tokens, max_context_length=needed), max_attempts=1
        )
        short = horde.send_chat(
            image_request(*urls, max_tokens=max_tokens, max_context_length=needed - 1), max_attempts=1
        )
        assert horde.wait([fits, short], timeout_s=20)
    finally:
        worker.stop()
    assert horde.status(fits)["done"]
    assert horde.status(short)["faulted"] and horde.status(short)["fault_reasons"] == ["prompt_overflow"]
    bodies = tokencount_bodies(kcpp)
    assert len(bodies) == 4 and all(b == counted_body for b in bodies)  # 3 jobs' and our own
    for stored in (PHOTO, OTHER_PHOTO):
        encoded = base64.b64encode(stored).decode("ascii")
        assert all(encoded[100:160] not in str(b) for b in bodies)
    assert all("data:" not in str(b) and "/o/img-" not in str(b) for b in bodies)
    assert len(kcpp.images) == 2  # the two jobs that fit were generated with both images


# --- the dev Horde's side of seed 004 (no worker) -----------------------------------------------


def test_non_jpeg_images_need_a_converter_and_jpegs_are_stored_as_sent(horde: DevHorde) -> None:
    for data, media_type in ((png(3, 2), "image/png"), (gif(), "image/gif"), (webp(), "image/webp")):
        with pytest.raises(ValueError, match="image_converter"):
            horde.send_chat(image_request(data_url(media_type, data)))
    answer = requests.post(
        horde.url + "/api/v2/generate/chat/async",
        json=image_request(data_url("image/png", png(3, 2))),
        timeout=5,
    )
    assert answer.status_code == 400 and answer.json()["rc"] == "ChatRequestInvalid"
    rid = horde.send_chat(image_request(data_url("image/png", PHOTO)))  # mislabelled: bytes decide
    assert horde.stored_images(rid) == [PHOTO]
    assert jpeg_size(PHOTO) == (24, 16)


def test_a_converter_output_is_stored_and_must_be_a_jpeg() -> None:
    seen: list[tuple[bytes, str]] = []

    def convert(data: bytes, media_type: str) -> bytes:
        seen.append((data, media_type))
        return PHOTO

    with DevHorde(api_keys=(API_KEY,), image_converter=convert) as h:
        rid = h.send_chat(image_request(data_url("image/gif", gif())))
        assert seen == [(gif(), "image/gif")] and h.stored_images(rid) == [PHOTO]
    with DevHorde(api_keys=(API_KEY,), image_converter=lambda d, t: d) as h, pytest.raises(
        ValueError, match="did not return a JPEG"
    ):
        h.send_chat(image_request(data_url("image/png", png())))


def wide(width: int) -> bytes:
    """PHOTO with its frame header claiming ``width`` pixels (the dev Horde reads the header)."""
    sof = PHOTO.index(b"\xff\xc0")
    return PHOTO[: sof + 7] + width.to_bytes(2, "big") + PHOTO[sof + 9 :]


def test_a_jpeg_longer_than_2048_pixels_is_converted_or_refused(horde: DevHorde) -> None:
    assert jpeg_size(wide(2048)) == (2048, 16) and jpeg_size(wide(2049)) == (2049, 16)
    assert horde.stored_images(horde.send_chat(image_request(data_url("image/jpeg", wide(2048))))) == [
        wide(2048)
    ]
    with pytest.raises(ValueError, match="2048"):
        horde.send_chat(image_request(data_url("image/jpeg", wide(2049))))
    horde.image_converter = to_jpeg
    assert horde.stored_images(horde.send_chat(image_request(data_url("image/jpeg", wide(2049))))) == [
        OTHER_PHOTO
    ]


def test_images_over_the_caps_are_refused_at_submit(horde: DevHorde) -> None:
    over = PHOTO + b"\x00" * (MAX_IMAGE_BYTES + 1 - len(PHOTO))
    with pytest.raises(ValueError, match="over the cap"):
        horde.send_chat(image_request(data_url("image/jpeg", over)))
    at_cap = PHOTO + b"\x00" * (MAX_IMAGE_BYTES - len(PHOTO))
    count = MAX_REQUEST_IMAGE_BYTES // MAX_IMAGE_BYTES + 1
    with pytest.raises(ValueError, match="per request"):
        horde.send_chat(image_request(*[data_url("image/jpeg", at_cap)] * count))


@pytest.fixture
def image_server() -> Iterator[JSONServer]:
    def handle(req: Request) -> Response:
        if req.path == "/photo.jpg":
            return Response(200, PHOTO, {"Content-Type": "application/octet-stream"})
        if req.path.startswith("/hop/"):
            left = int(req.path.rsplit("/", 1)[1])
            target = "/photo.jpg" if left == 0 else f"/hop/{left - 1}"
            return Response(302, b"", {"Location": target})
        return Response(404, b"")

    with JSONServer(handle, name="image-server") as server:
        yield server


def test_an_http_image_url_on_localhost_is_fetched_at_submit_following_3_redirects(
    horde: DevHorde, image_server: JSONServer
) -> None:
    rid = horde.send_chat(image_request(image_server.url + "/photo.jpg"))
    assert horde.stored_images(rid) == [PHOTO]
    assert horde.stored_images(horde.send_chat(image_request(image_server.url + "/hop/2"))) == [PHOTO]
    with pytest.raises(ValueError, match="redirected more than 3"):
        horde.send_chat(image_request(image_server.url + "/hop/3"))
    with pytest.raises(ValueError, match="HTTP 404"):
        horde.send_chat(image_request(image_server.url + "/missing.jpg"))
    with pytest.raises(ValueError, match="127.0.0.1 only"):
        horde.send_chat(image_request("http://example.invalid/photo.jpg"))


def test_image_urls_are_signed_for_at_least_600_seconds_and_checked(horde: DevHorde) -> None:
    rid = horde.send_chat(image_request(data_url("image/jpeg", PHOTO)), best_effort=True)
    body = {
        "name": "w",
        "models": [MODEL],
        "chat_jobs": True,
        "chat_features": ["vision"],
        "chat_limits": {"max_context_length": 4096, "max_length": 512},
        "model_id": MODEL,
        "image_transports": ["url"],
        "bridge_agent": "KoboldCppEmbedWorker:2:https://github.com/LostRuins/koboldcpp",
    }
    popped = requests.post(horde.url + "/api/v2/generate/text/pop", json=body, headers={"apikey": API_KEY}, timeout=5)
    assert popped.json()["id"] is not None and horde.status(rid)["state"] == "processing"
    (url,) = popped_image_urls(horde)
    exp = float(parse_qs(urlsplit(url).query)["exp"][0])
    assert 600 - 5 <= exp - time.time() <= 600 + 5
    ok = requests.get(url, timeout=5)
    assert ok.status_code == 200 and ok.content == PHOTO
    assert ok.headers["Content-Type"] == "application/octet-stream"  # a generic type: sniff the bytes
    assert requests.get(url.replace("sig=", "sig=0"), timeout=5).status_code == 403
    later = url.replace(f"exp={parse_qs(urlsplit(url).query)['exp'][0]}", f"exp={exp + 1:.3f}")
    assert requests.get(later, timeout=5).status_code == 403  # the signature covers the expiry


# --- koboldcpp's --maxrequestsize -------------------------------------------------------------

BIG_PHOTO = jpeg(64, 64)  # about 12 kB, 16 kB as base64
SMALL_LIMIT = 12_000  # koboldcpp started with a (tiny) --maxrequestsize, in bytes


@pytest.mark.parametrize("kcpp", [{"vision": True, "max_request_bytes": SMALL_LIMIT}], indirect=True)
def test_a_chat_request_koboldcpp_would_refuse_as_too_big_is_faulted_without_sending_it(
    horde: DevHorde, kcpp: ScriptedKoboldcpp
) -> None:
    """koboldcpp answers a body over --maxrequestsize with 500 "Payload is too big"
    (koboldcpp 1.116.1 koboldcpp.py L6422-6431). The image makes the chat request too big (the fit count sends no
    image bytes, so it fits): the worker faults the job without a reason, and never
    sends it; a small job afterwards is served."""
    assert len(json.dumps(image_request(data_url("image/jpeg", BIG_PHOTO)))) > SMALL_LIMIT
    big = horde.send_chat(image_request(data_url("image/jpeg", BIG_PHOTO)), max_attempts=1)
    settings = WorkerSettings(
        api_key=API_KEY,
        worker_name="test-worker",
        model_id=MODEL,
        backend_max_context_length=kcpp.max_context_length,
        max_length=512,
        horde_url=horde.url,
        kcpp_url=kcpp.url,
        vision=True,
        local_idle_s=0.0,
        kcpp_max_request_bytes=SMALL_LIMIT,
    )
    stop = threading.Event()
    thread = threading.Thread(
        target=run_worker,
        args=(settings,),
        kwargs={"state": WorkerState(settings, stop_event=stop), "caps": BackendCapabilities(vision=True, image_url=True)},
        daemon=True,
    )
    thread.start()
    try:
        assert horde.wait([big], timeout_s=20)
        the_single_fault_without_reason(horde, big)
        small = horde.send_chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
        assert horde.wait([small], timeout_s=20)
    finally:
        stop.set()
        thread.join(15)
    assert [e["action"] for e in horde.ledger] == ["faulted", "submitted"]
    assert len(tokencount_bodies(kcpp)) == 2  # both were fit-counted
    chats = [r for r in kcpp.requests if r["path"] == "/v1/chat/completions"]
    assert len(chats) == 1 and chats[0]["body"]["messages"][0]["content"] == "hi"
