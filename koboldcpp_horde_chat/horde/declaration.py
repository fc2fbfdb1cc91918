"""The chat declaration sent on every pop, and the model name it declares (pure; no I/O).

Seed sections: "1. Declare chat on pop" and "Worked example: koboldcpp's
embedded worker".

Every feature decision lives in one table, :data:`FEATURE_TABLE`, with the
reason for it, so that what the worker declares can be read (and changed) in
one place. The table also holds the names the worker deliberately does *not*
declare, with the reason why.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from ..settings import WorkerSettings

log = logging.getLogger("koboldcpp_horde_chat.declaration")

TOOLS_MAX_TEMPERATURE = 1.0
"""koboldcpp clamps the temperature of a tool request to 1.0 (1.116.1 ``koboldcpp.py`` L4414)."""

KOBOLDCPP_PREFIX = "koboldcpp/"
INACTIVE_MODEL_NAME = "inactive"
"""koboldcpp's ``friendlymodelname`` when no model is loaded (1.116.1 ``koboldcpp.py`` L88)."""

FeatureKind = Literal["feature", "guarantee"]


@dataclass(frozen=True)
class BackendCapabilities:
    """What the koboldcpp behind the worker can do, as far as the declaration cares.

    Attributes:
        vision: a multimodal projector that reads images is loaded
            (``/api/extra/version`` reports ``"vision": true``).
        messages_url: the worker fetches offloaded messages (``messages_url``).
        image_url: the worker fetches signed image URLs itself (the ``url``
            transport); koboldcpp alone reads only data URLs.
        chat: koboldcpp has ``POST /v1/chat/completions`` (1.46 and later:
            ``koboldcpp.versions``); without it no pop declares chat.
    """

    vision: bool = False
    messages_url: bool = True
    image_url: bool = False
    chat: bool = True


@dataclass(frozen=True)
class FeatureRow:
    """One feature decision.

    Attributes:
        name: the ``chat_features`` value (``"seed"``, ``"prompt_overflow_refused"``...).
        kind: ``"feature"`` (optional capability) or ``"guarantee"`` (the backend
            follows one part of the OpenAI contract exactly).
        applies: whether the name is declared for a backend with these capabilities.
        reason: why it is (or is not) declared, for readers and logs.
    """

    name: str
    kind: FeatureKind
    applies: Callable[[BackendCapabilities], bool]
    reason: str


def _always(caps: BackendCapabilities) -> bool:
    return True


def _never(caps: BackendCapabilities) -> bool:
    return False


def _with_vision(caps: BackendCapabilities) -> bool:
    return caps.vision


FEATURE_TABLE: tuple[FeatureRow, ...] = (
    FeatureRow(
        "seed",
        "feature",
        _always,
        "koboldcpp reads the chat body's seed as its sampler seed.",
    ),
    FeatureRow(
        "presence_penalty",
        "feature",
        _always,
        "koboldcpp applies presence_penalty from the chat body.",
    ),
    FeatureRow(
        "tools",
        "feature",
        _always,
        "koboldcpp renders tool definitions, assistant tool calls and tool results, "
        "and returns the model's calls as tool_calls.",
    ),
    FeatureRow(
        "json_object",
        "feature",
        _always,
        "koboldcpp roots its own json_object grammar at an array, so the worker "
        "replaces response_format json_object with a GBNF grammar rooted at an object "
        "(translate.bodies.OBJECT_JSON_GRAMMAR).",
    ),
    FeatureRow(
        "json_schema",
        "feature",
        _always,
        "koboldcpp converts response_format.json_schema.schema to a grammar.",
    ),
    FeatureRow(
        "reasoning_effort",
        "feature",
        _always,
        "koboldcpp maps reasoning_effort to a thinking budget.",
    ),
    FeatureRow(
        "prompt_overflow_refused",
        "guarantee",
        _always,
        "The worker's fit check faults a conversation that does not fit with "
        "prompt_overflow instead of letting koboldcpp cut its front.",
    ),
    FeatureRow(
        "vision",
        "feature",
        _with_vision,
        "Declared only while a multimodal projector that reads images is loaded.",
    ),
    FeatureRow(
        "frequency_penalty",
        "feature",
        _never,
        "koboldcpp reads frequency_penalty only as a fallback for a missing presence "
        "penalty, so it is not applied as a separate penalty.",
    ),
    FeatureRow(
        "tools_with_response_format",
        "feature",
        _never,
        "koboldcpp's tool grammar replaces the response format grammar, so a request "
        "with both is left to other workers.",
    ),
    FeatureRow(
        "tool_choice_enforced",
        "guarantee",
        _never,
        "koboldcpp decides on a tool call with a model poll and does not check the reply "
        "against tool_choice, so a strict tool_choice is left to other workers.",
    ),
    FeatureRow(
        "structured_output_enforced",
        "guarantee",
        _never,
        "koboldcpp discards a schema it cannot convert to a grammar and generates "
        "unconstrained, so conformance to response_format is not guaranteed.",
    ),
)


def chat_features(
    caps: BackendCapabilities, withhold: Iterable[str] = frozenset()
) -> list[str]:
    """The ``chat_features`` list: every applicable row of :data:`FEATURE_TABLE`.

    Args:
        caps: the backend's capabilities.
        withhold: names the operator withholds; removed whether they are
            features or guarantees (configuration can withhold, never establish).

    Returns:
        Names in table order, e.g. ``["seed", "presence_penalty", "tools",
        "json_object", "json_schema", "reasoning_effort",
        "prompt_overflow_refused"]`` plus ``"vision"`` with ``caps.vision``.

    Seed: "Features and guarantees".
    """
    withheld = frozenset(withhold)
    return [row.name for row in FEATURE_TABLE if row.applies(caps) and row.name not in withheld]


def image_transports(caps: BackendCapabilities) -> list[str]:
    """The ``image_transports`` list, in the order ``messages_url``, ``base64``, ``url``.

    ``messages_url`` when ``caps.messages_url`` (it can be declared without
    vision); ``base64`` and, with ``caps.image_url``, ``url`` only with
    ``caps.vision``. An empty list means no images and no offloaded messages.

    Seed: "Image transports"; seed 004.
    """
    transports: list[str] = []
    if caps.messages_url:
        transports.append("messages_url")
    if caps.vision:
        transports.append("base64")
        if caps.image_url:
            transports.append("url")
    return transports


def chat_limits(settings: WorkerSettings) -> dict[str, Any]:
    """The ``chat_limits`` object, in tokens.

    ``{"max_context_length": settings.max_context_length, "max_length":
    WorkerSettings.declared_max_length, "tools_max_temperature": 1.0}``: the
    ``max_length`` is ``--hordegenlen`` lowered so that a job leaves room for
    a prompt (:attr:`.settings.WorkerSettings.declared_max_length`).

    Seed: "Chat limits"; worked example.
    """
    return {
        "max_context_length": settings.max_context_length,
        "max_length": settings.declared_max_length,
        "tools_max_temperature": TOOLS_MAX_TEMPERATURE,
    }


def chat_declaration(
    settings: WorkerSettings,
    caps: BackendCapabilities,
    *,
    withhold: Iterable[str] = frozenset(),
) -> dict[str, Any]:
    """The chat declaration fields of a pop body.

    Returns ``{"chat_jobs": true, "chat_features": [...], "chat_limits": {...},
    "model_id": settings.model_id, "image_transports": [...]}`` plus
    ``"prompt_jobs": false`` only when ``WorkerSettings.prompt_jobs`` is False.

    ``withhold`` is added to ``WorkerSettings.chat_withhold``. When ``vision`` is
    withheld, ``base64`` and ``url`` are not declared either, since a worker
    without vision receives no images.

    Seed: "1. Declare chat on pop".
    """
    withheld = frozenset(withhold) | settings.chat_withhold
    features = chat_features(caps, withheld)
    transport_caps = caps
    if caps.vision and "vision" not in features:
        transport_caps = BackendCapabilities(
            vision=False, messages_url=caps.messages_url, image_url=caps.image_url
        )
    body: dict[str, Any] = {
        "chat_jobs": True,
        "chat_features": features,
        "chat_limits": chat_limits(settings),
        "model_id": settings.model_id,
        "image_transports": image_transports(transport_caps),
    }
    if settings.prompt_jobs is False:
        body["prompt_jobs"] = False
    return body


def pop_body(
    settings: WorkerSettings,
    caps: BackendCapabilities,
    *,
    withhold: Iterable[str] = frozenset(),
    chat_jobs: bool = True,
    max_length: int | None = None,
    chat_max_length: int | None = None,
    prompt_jobs: bool = True,
    max_context_length: int | None = None,
    chat_max_context_length: int | None = None,
) -> dict[str, Any]:
    """The whole body of ``POST /api/v2/generate/text/pop``.

    ``{"name", "models": [model_id], "max_length", "max_context_length",
    "priority_usernames": [], "softprompts": [], "bridge_agent"}``, plus
    ``"threads"`` when ``settings.threads > 1``, plus the fields of
    :func:`chat_declaration` when ``chat_jobs`` and koboldcpp has the chat
    route (``caps.chat``). Otherwise the declaration is withdrawn (or never
    made): no chat field and no ``prompt_jobs`` is sent.
    Lengths are tokens: the text limits are koboldcpp's own worker's, with
    ``max_length`` lowered as the chat one is (``WorkerSettings.declared_max_length``).
    ``max_length`` and ``chat_max_length``, when given, replace the text
    ``max_length`` and ``chat_limits.max_length`` (lowered so that a job
    finishes within its lease: ``state.lease_fit``), never above
    ``WorkerSettings.declared_max_length``. ``max_context_length`` and
    ``chat_max_context_length``, when given, replace the text
    ``max_context_length`` and ``chat_limits.max_context_length`` the same
    way (narrowed so that a job's prompt is processed within its lease), never
    above ``WorkerSettings.max_context_length``. ``prompt_jobs`` False (text generations
    fail) with ``chat_jobs`` sends ``"prompt_jobs": false``: chat jobs only (seed:
    "Send prompt_jobs: false with chat_jobs: true to serve chat jobs only").

    Seed: "1. Declare chat on pop", "Declaration checks and withdrawal".
    """
    body: dict[str, Any] = {
        "name": settings.worker_name,
        "models": [settings.model_id],
        "max_length": _at_most(max_length, settings.declared_max_length),
        "max_context_length": _at_most(max_context_length, settings.max_context_length),
        "priority_usernames": [],
        "softprompts": [],
        "bridge_agent": settings.bridge_agent,
    }
    if settings.threads > 1:
        body["threads"] = settings.threads
    if chat_jobs and caps.chat:
        body.update(chat_declaration(settings, caps, withhold=withhold))
        limits = dict(body["chat_limits"])
        if chat_max_length is not None:
            limits["max_length"] = _at_most(chat_max_length, settings.declared_max_length)
        if chat_max_context_length is not None:
            limits["max_context_length"] = _at_most(
                chat_max_context_length, settings.max_context_length
            )
        body["chat_limits"] = limits
        if not prompt_jobs:
            body["prompt_jobs"] = False
    return body


def _at_most(value: int | None, cap: int) -> int:
    """``value`` (at least 1) capped at ``cap``; ``cap`` when None."""
    return cap if value is None else max(1, min(value, cap))


_UNSAFE_NAME_CHARS = re.compile(r"[^\w.\-]")


def _sanitise(name: str) -> str:
    """Keep word characters, digits, ``.``, ``-`` and ``_`` (koboldcpp's ``sanitize_string``)."""
    return _UNSAFE_NAME_CHARS.sub("", name)


def koboldcpp_model_name(
    *, hordemodelname: str, model_path: str, debugmode: int, gendefaults: str
) -> str:
    """The model name koboldcpp registers (its ``friendlymodelname``).

    koboldcpp 1.116.1 ``koboldcpp.py`` L11453-11465:

    - From the model file: ``"koboldcpp/"`` + the sanitised file name without
      its extension; ``/m/Qwen3-8B-Q4_K_M.gguf`` gives ``koboldcpp/Qwen3-8B-Q4_K_M``.
    - ``--hordemodelname`` replaces it, unsanitised: ``debug-`` is put in front
      first when ``debugmode == 1`` or ``gendefaults`` is non-empty, then
      ``koboldcpp/`` unless the name already starts with it (``Foo`` with debug
      gives ``koboldcpp/debug-Foo``).
    - Neither: ``"inactive"``.

    Seed: worked example ("model_id as the model name it registers").
    """
    name = INACTIVE_MODEL_NAME
    if model_path:
        stem = os.path.splitext(os.path.basename(model_path))[0]
        name = KOBOLDCPP_PREFIX + _sanitise(stem)
    if hordemodelname:
        name = hordemodelname
        if debugmode == 1 or gendefaults:
            name = "debug-" + name
        if not name.startswith(KOBOLDCPP_PREFIX):
            name = KOBOLDCPP_PREFIX + name
    return name


def standalone_model_id(backend_model_name: str, hordemodelname: str) -> str:
    """The model id of the standalone worker.

    ``backend_model_name`` is ``/api/v1/model``'s ``result``, to which koboldcpp
    already applied its naming rule. A non-empty ``hordemodelname`` replaces it,
    with ``koboldcpp/`` put in front unless it is already there.
    """
    if hordemodelname:
        if hordemodelname.startswith(KOBOLDCPP_PREFIX):
            return hordemodelname
        return KOBOLDCPP_PREFIX + hordemodelname
    return backend_model_name


def model_id_warnings(model_id: str) -> list[str]:
    """Human-readable warnings about a model id; empty when it is fine.

    A colon makes the model unreachable through the OpenAI-compatible front
    (seed: "Model id"). ``inactive`` means koboldcpp has no text model loaded.
    """
    warnings: list[str] = []
    if not model_id:
        warnings.append("the model id is empty")
    if ":" in model_id:
        warnings.append(
            f"model id {model_id!r} contains ':', so the Horde's OpenAI-compatible front "
            "cannot reach it; choose a name without a colon"
        )
    if model_id == INACTIVE_MODEL_NAME:
        warnings.append("koboldcpp reports no loaded text model ('inactive')")
    return warnings
