"""The chat declaration sent on every pop, and the model name it declares (pure).

Seed sections "1. Declare chat on pop" and "Worked example: koboldcpp's embedded
worker". :data:`FEATURE_TABLE` holds every feature decision with its reason,
including the names deliberately not declared.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from ..settings import WorkerSettings

#: koboldcpp clamps the temperature of a tool request to 1.0 (1.116.1 ``koboldcpp.py`` L4414).
TOOLS_MAX_TEMPERATURE = 1.0
KOBOLDCPP_PREFIX = "koboldcpp/"
#: koboldcpp's ``friendlymodelname`` when no model is loaded (1.116.1 ``koboldcpp.py`` L88).
INACTIVE_MODEL_NAME = "inactive"


@dataclass(frozen=True)
class BackendCapabilities:
    """What the koboldcpp behind the worker can do: ``vision`` (a projector that reads
    images), ``messages_url`` and ``image_url`` (the worker fetches offloaded messages,
    signed image URLs), ``chat`` (koboldcpp has the chat route; without it no chat)."""

    vision: bool = False
    messages_url: bool = True
    image_url: bool = False
    chat: bool = True


@dataclass(frozen=True)
class FeatureRow:
    """One ``chat_features`` name: a ``"feature"`` (optional capability) or a
    ``"guarantee"`` (one part of the OpenAI contract followed exactly), when it is
    declared, and why."""

    name: str
    kind: Literal["feature", "guarantee"]
    declared: Literal["always", "with vision", "never"]
    reason: str


FEATURE_TABLE: tuple[FeatureRow, ...] = tuple(FeatureRow(*row) for row in (
    ("seed", "feature", "always",
     "koboldcpp reads the chat body's seed as its sampler seed."),
    ("presence_penalty", "feature", "always",
     "koboldcpp applies presence_penalty from the chat body."),
    ("tools", "feature", "always",
     "koboldcpp renders tool definitions, assistant tool calls and tool results, and returns "
     "the model's calls as tool_calls."),
    ("json_object", "feature", "always",
     "koboldcpp roots its own json_object grammar at an array, so the worker replaces "
     "response_format json_object with a GBNF grammar rooted at an object "
     "(translate.bodies.OBJECT_JSON_GRAMMAR)."),
    ("json_schema", "feature", "always",
     "koboldcpp converts response_format.json_schema.schema to a grammar."),
    ("reasoning_effort", "feature", "always",
     "koboldcpp maps reasoning_effort to a thinking budget."),
    ("prompt_overflow_refused", "guarantee", "always",
     "The worker's fit check faults a conversation that does not fit with prompt_overflow "
     "instead of letting koboldcpp cut its front."),
    ("vision", "feature", "with vision",
     "Declared only while a multimodal projector that reads images is loaded."),
    ("frequency_penalty", "feature", "never",
     "koboldcpp reads frequency_penalty only as a fallback for a missing presence penalty, so "
     "it is not applied as a separate penalty."),
    ("tools_with_response_format", "feature", "never",
     "koboldcpp's tool grammar replaces the response format grammar, so a request with both is "
     "left to other workers."),
    ("tool_choice_enforced", "guarantee", "never",
     "koboldcpp decides on a tool call with a model poll and does not check the reply against "
     "tool_choice, so a strict tool_choice is left to other workers."),
    ("structured_output_enforced", "guarantee", "never",
     "koboldcpp discards a schema it cannot convert to a grammar and generates unconstrained, "
     "so conformance to response_format is not guaranteed."),
))


def chat_features(caps: BackendCapabilities, withhold: Iterable[str] = frozenset()) -> list[str]:
    """The declared names in table order, less ``withhold`` (configuration can withhold,
    never establish). Seed: "Features and guarantees"."""
    withheld = frozenset(withhold)
    return [
        row.name for row in FEATURE_TABLE
        if row.name not in withheld
        and (row.declared == "always" or (row.declared == "with vision" and caps.vision))
    ]


def image_transports(caps: BackendCapabilities) -> list[str]:
    """``image_transports``: ``base64`` and ``url`` only with vision (seed 004)."""
    offered = (("messages_url", caps.messages_url), ("base64", caps.vision),
               ("url", caps.vision and caps.image_url))
    return [name for name, on in offered if on]


def pop_body(
    settings: WorkerSettings, caps: BackendCapabilities, *, withhold: Iterable[str] = frozenset(),
    chat_jobs: bool = True, prompt_jobs: bool = True,
    limits: Mapping[str, tuple[int | None, int | None]] | None = None,
) -> dict[str, Any]:
    """The whole pop body (seed "1. Declare chat on pop", "Declaration checks and
    withdrawal"); lengths in tokens.

    The chat fields only with ``chat_jobs`` and ``caps.chat``, else withdrawn.
    ``limits`` per kind (``"text"``, ``"chat"``): ``(max_length,
    max_context_length)`` lowered to fit a job in its lease (None: not lowered),
    declared instead of ``settings``' but never above them. ``prompt_jobs`` False
    (or ``WorkerSettings.prompt_jobs``) with chat sends ``"prompt_jobs": false``: chat
    jobs only. ``withhold`` adds to ``WorkerSettings.chat_withhold``; withholding
    ``vision`` drops the image transports too.
    """
    fit = limits or {}
    body: dict[str, Any] = {
        "name": settings.worker_name,
        "models": [settings.model_id],
        **_lowered(settings, fit.get("text")),
        "priority_usernames": [],
        "softprompts": [],
        "bridge_agent": settings.bridge_agent,
    }
    if settings.threads > 1:
        body["threads"] = settings.threads
    if chat_jobs and caps.chat:
        features = chat_features(caps, frozenset(withhold) | settings.chat_withhold)
        body.update({
            "chat_jobs": True,
            "chat_features": features,
            "chat_limits": {  # seed "Chat limits"
                "max_context_length": settings.max_context_length,
                "max_length": settings.declared_max_length,
                "tools_max_temperature": TOOLS_MAX_TEMPERATURE,
            },
            "model_id": settings.model_id,
            "image_transports": image_transports(replace(caps, vision="vision" in features)),
        })
        body["chat_limits"].update(_lowered(settings, fit.get("chat")))
        if not (prompt_jobs and settings.prompt_jobs):
            body["prompt_jobs"] = False
    return body


def _lowered(
    settings: WorkerSettings, limit: tuple[int | None, int | None] | None
) -> dict[str, int]:
    length, context = limit or (None, None)
    return {
        "max_length": _at_most(length, settings.declared_max_length),
        "max_context_length": _at_most(context, settings.max_context_length),
    }


def _at_most(value: int | None, cap: int) -> int:
    return cap if value is None else max(1, min(value, cap))


def standalone_model_id(backend_model_name: str, hordemodelname: str) -> str:
    """The standalone worker's model id: ``/api/v1/model``'s name, or
    ``hordemodelname`` with ``koboldcpp/`` in front."""
    if not hordemodelname or hordemodelname.startswith(KOBOLDCPP_PREFIX):
        return hordemodelname or backend_model_name
    return KOBOLDCPP_PREFIX + hordemodelname


def model_id_warnings(model_id: str) -> list[str]:
    """Warnings about a model id for the operator (seed "Model id")."""
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
