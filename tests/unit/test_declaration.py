"""The chat declaration on pop (seed step 1, worked example)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from koboldcpp_horde_chat import BRIDGE_AGENT
from koboldcpp_horde_chat.horde.declaration import (
    FEATURE_TABLE,
    TOOLS_MAX_TEMPERATURE,
    BackendCapabilities,
    chat_features,
    image_transports,
    model_id_warnings,
    pop_body,
    standalone_model_id,
)
from koboldcpp_horde_chat.settings import WorkerSettings

MODEL = "koboldcpp/Qwen3-8B-Q4_K_M"
EMBEDDED_FEATURES = [
    "seed",
    "presence_penalty",
    "tools",
    "json_object",
    "json_schema",
    "reasoning_effort",
    "prompt_overflow_refused",
]
NEVER_DECLARED = {
    "frequency_penalty",
    "tools_with_response_format",
    "tool_choice_enforced",
    "structured_output_enforced",
}
ALL_CAPS = [
    BackendCapabilities(vision=v, messages_url=m, image_url=u)
    for v, m, u in itertools.product([False, True], repeat=3)
]


def settings(**changes: object) -> WorkerSettings:
    base = WorkerSettings(
        api_key="0000000000",
        worker_name="my-worker",
        model_id=MODEL,
        backend_max_context_length=4096,
        max_length=512,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


# --- features ------------------------------------------------------------------------


def test_a_backend_without_vision_declares_the_embedded_workers_features() -> None:
    assert chat_features(BackendCapabilities()) == EMBEDDED_FEATURES


def test_vision_is_declared_only_with_a_projector_that_reads_images() -> None:
    assert "vision" in chat_features(BackendCapabilities(vision=True))
    assert "vision" not in chat_features(BackendCapabilities(vision=False))
    assert sorted(chat_features(BackendCapabilities(vision=True))) == sorted(
        EMBEDDED_FEATURES + ["vision"]
    )


@pytest.mark.parametrize("caps", ALL_CAPS)
def test_features_koboldcpp_does_not_implement_are_never_declared(
    caps: BackendCapabilities,
) -> None:
    assert NEVER_DECLARED.isdisjoint(chat_features(caps))


def test_the_table_keeps_a_reason_for_every_decision_including_the_refusals() -> None:
    names = [row.name for row in FEATURE_TABLE]
    assert len(names) == len(set(names))
    assert NEVER_DECLARED <= set(names)
    for row in FEATURE_TABLE:
        assert row.kind in ("feature", "guarantee")
        assert len(row.reason) > 20, row.name
    kinds = {row.name: row.kind for row in FEATURE_TABLE}
    assert kinds["prompt_overflow_refused"] == "guarantee"
    assert kinds["tool_choice_enforced"] == "guarantee"
    assert kinds["structured_output_enforced"] == "guarantee"
    assert kinds["tools"] == "feature"


def test_withholding_removes_features_and_guarantees_alike() -> None:
    features = chat_features(
        BackendCapabilities(vision=True), {"prompt_overflow_refused", "tools", "vision"}
    )
    assert features == ["seed", "presence_penalty", "json_object", "json_schema", "reasoning_effort"]


def test_withholding_cannot_establish_a_name() -> None:
    assert chat_features(BackendCapabilities(), {"tool_choice_enforced"}) == EMBEDDED_FEATURES


# --- image transports -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("caps", "expected"),
    [
        (BackendCapabilities(), ["messages_url"]),
        (BackendCapabilities(messages_url=False), []),
        (BackendCapabilities(image_url=True), ["messages_url"]),
        (BackendCapabilities(vision=True), ["messages_url", "base64"]),
        (BackendCapabilities(vision=True, image_url=True), ["messages_url", "base64", "url"]),
        (BackendCapabilities(vision=True, messages_url=False), ["base64"]),
        (BackendCapabilities(vision=True, messages_url=False, image_url=True), ["base64", "url"]),
    ],
)
def test_image_transports(caps: BackendCapabilities, expected: list[str]) -> None:
    assert image_transports(caps) == expected


# --- the declaration -----------------------------------------------------------------


def test_chat_limits_are_the_workers_limits_and_koboldcpps_tool_clamp() -> None:
    declaration = pop_body(settings(horde_max_context_length=2048), BackendCapabilities())
    assert declaration["chat_limits"] == {
        "max_context_length": 2048,
        "max_length": 512,
        "tools_max_temperature": 1.0,
    }
    assert TOOLS_MAX_TEMPERATURE == 1.0


def test_the_declaration_has_the_seeds_five_fields() -> None:
    body = pop_body(settings(), BackendCapabilities())
    text_fields = pop_body(settings(), BackendCapabilities(), chat_jobs=False)
    declaration = {k: v for k, v in body.items() if k not in text_fields}
    assert declaration == {
        "chat_jobs": True,
        "chat_features": EMBEDDED_FEATURES,
        "chat_limits": {"max_context_length": 4096, "max_length": 512, "tools_max_temperature": 1.0},
        "model_id": MODEL,
        "image_transports": ["messages_url"],
    }


def test_prompt_jobs_false_is_sent_only_for_a_chat_only_worker() -> None:
    assert "prompt_jobs" not in pop_body(settings(), BackendCapabilities())
    only_chat = pop_body(settings(prompt_jobs=False), BackendCapabilities())
    assert only_chat["prompt_jobs"] is False


def test_operator_withholding_from_settings_and_argument_combine() -> None:
    declaration = pop_body(
        settings(chat_withhold=frozenset({"seed"})),
        BackendCapabilities(),
        withhold={"prompt_overflow_refused"},
    )
    assert "seed" not in declaration["chat_features"]
    assert "prompt_overflow_refused" not in declaration["chat_features"]
    assert "tools" in declaration["chat_features"]


def test_withholding_vision_also_drops_the_image_transports() -> None:
    caps = BackendCapabilities(vision=True, image_url=True)
    declaration = pop_body(settings(), caps, withhold={"vision"})
    assert "vision" not in declaration["chat_features"]
    assert declaration["image_transports"] == ["messages_url"]


def test_a_vision_declaration_carries_base64() -> None:
    declaration = pop_body(settings(), BackendCapabilities(vision=True))
    assert "vision" in declaration["chat_features"]
    assert declaration["image_transports"] == ["messages_url", "base64"]


# --- the pop body -------------------------------------------------------------------


def test_the_pop_body_carries_the_text_fields_and_the_declaration() -> None:
    body = pop_body(settings(horde_max_context_length=2048), BackendCapabilities())
    assert body == {
        "name": "my-worker",
        "models": [MODEL],
        "max_length": 512,
        "max_context_length": 2048,
        "priority_usernames": [],
        "softprompts": [],
        "bridge_agent": BRIDGE_AGENT,
        "chat_jobs": True,
        "chat_features": EMBEDDED_FEATURES,
        "chat_limits": {"max_context_length": 2048, "max_length": 512, "tools_max_temperature": 1.0},
        "model_id": MODEL,
        "image_transports": ["messages_url"],
    }


def test_a_genlen_that_leaves_no_room_for_a_prompt_is_declared_lower_for_chat_and_text() -> None:
    # --hordegenlen 100000 on a 4096-token koboldcpp: koboldcpp cuts any budget above
    # 3277 for that context, and a job asking more than that leaves no room for a prompt
    body = pop_body(settings(max_length=100_000), BackendCapabilities())
    assert body["max_length"] == 3277
    assert body["chat_limits"] == {
        "max_context_length": 4096,
        "max_length": 3277,
        "tools_max_temperature": 1.0,
    }
    body = pop_body(settings(max_length=100_000, horde_max_context_length=2048),
                    BackendCapabilities())
    assert (body["max_length"], body["chat_limits"]["max_length"]) == (1639, 1639)


@pytest.mark.parametrize("caps", ALL_CAPS)
@pytest.mark.parametrize("prompt_jobs", [True, False])
def test_every_pop_passes_the_hordes_declaration_checks(
    caps: BackendCapabilities, prompt_jobs: bool
) -> None:
    body = pop_body(settings(prompt_jobs=prompt_jobs), caps)
    # The checks behind 400 ChatDeclarationInvalid (seed: "Declaration checks").
    assert body["chat_jobs"] is True
    assert body["model_id"] in body["models"]
    assert ":" not in body["model_id"]
    assert body["chat_limits"]["tools_max_temperature"] >= 0
    if body.get("prompt_jobs") is False:
        assert body["chat_jobs"] is True
    # A request with images reaches the worker only with vision and an image transport.
    if "vision" in body["chat_features"]:
        assert {"base64", "url"} & set(body["image_transports"])
    else:
        assert not {"base64", "url"} & set(body["image_transports"])


def test_threads_is_sent_only_for_several_threads() -> None:
    assert "threads" not in pop_body(settings(threads=1), BackendCapabilities())
    assert pop_body(settings(threads=3), BackendCapabilities())["threads"] == 3


def test_a_withdrawn_declaration_leaves_out_every_chat_field() -> None:
    body = pop_body(settings(prompt_jobs=False), BackendCapabilities(), chat_jobs=False)
    assert body == {
        "name": "my-worker",
        "models": [MODEL],
        "max_length": 512,
        "max_context_length": 4096,
        "priority_usernames": [],
        "softprompts": [],
        "bridge_agent": BRIDGE_AGENT,
    }


# --- model names ----------------------------------------------------------------------


def test_standalone_model_id() -> None:
    assert standalone_model_id("koboldcpp/SmolLM2-135M-Instruct.Q4_1", "") == (
        "koboldcpp/SmolLM2-135M-Instruct.Q4_1"
    )
    assert standalone_model_id("koboldcpp/x", "Foo") == "koboldcpp/Foo"
    assert standalone_model_id("koboldcpp/x", "koboldcpp/Foo") == "koboldcpp/Foo"


def test_a_colon_in_the_model_id_is_warned_about() -> None:
    assert model_id_warnings(MODEL) == []
    warnings = model_id_warnings("koboldcpp/qwen3:8b")
    assert len(warnings) == 1
    assert "':'" in warnings[0]
    assert model_id_warnings("inactive")


# --- the max_length that fits the lease (state.lease_fit) ---------------------------


def test_the_lengths_fitted_to_the_lease_replace_the_text_and_chat_max_length() -> None:
    body = pop_body(settings(), BackendCapabilities(), limits={"text": (240, None), "chat": (112, None)})
    assert body["max_length"] == 240
    assert body["chat_limits"]["max_length"] == 112
    assert body["chat_limits"]["max_context_length"] == 4096  # the context is not narrowed
    assert body["max_context_length"] == 4096


def test_a_fitted_length_is_never_declared_above_hordegenlen_nor_below_one() -> None:
    body = pop_body(settings(), BackendCapabilities(), limits={"text": (4096, None), "chat": (513, None)})
    assert (body["max_length"], body["chat_limits"]["max_length"]) == (512, 512)
    body = pop_body(settings(), BackendCapabilities(), limits={"text": (0, None), "chat": (-5, None)})
    assert (body["max_length"], body["chat_limits"]["max_length"]) == (1, 1)
    # Without a fitted length the operator's length is declared, as before.
    body = pop_body(settings(), BackendCapabilities())
    assert (body["max_length"], body["chat_limits"]["max_length"]) == (512, 512)
