"""The requests the benchmarks queue at the dev Horde: a client's chat with tools, a
text prompt, and a large offloaded conversation with images."""

from __future__ import annotations

import base64
import copy
import json
import random
import struct
from typing import Any


def chat_body(n_messages: int = 20, *, tools: bool = True, stream: bool = False) -> dict[str, Any]:
    """A client's chat request: ``n_messages`` messages (system, user/assistant turns,
    one earlier tool call and its result, ending with a user turn) and 2 tools."""
    rng = random.Random(6)
    words = (
        "the a worker horde model token context reply stream image tool call weather city "
        "search result kobold prompt queue lease fault submit progress reason summary"
    ).split()

    def sentence(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n)).capitalize() + "."

    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful assistant. " + sentence(30)}
    ]
    turn = 0
    while len(messages) < n_messages - 1:
        turn += 1
        if tools and turn == 3 and len(messages) <= n_messages - 4:
            messages.append({"role": "user", "content": "What is the weather in Lyon? " + sentence(10)})
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_12345",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'},
                        }
                    ],
                }
            )
            messages.append(
                {"role": "tool", "tool_call_id": "call_12345", "content": '{"temp_c": 18, "sky": "clear"}'}
            )
            continue
        role = "user" if messages[-1]["role"] != "user" else "assistant"
        messages.append({"role": role, "content": sentence(40 if role == "assistant" else 25)})
    if messages[-1]["role"] == "user":
        messages.append({"role": "assistant", "content": sentence(30)})
    messages.append({"role": "user", "content": "And what about Paris? " + sentence(12)})
    body: dict[str, Any] = {"messages": messages[:n_messages], "max_tokens": 128, "temperature": 0.7}
    if tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Current weather for a city.",
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "description": "City name"}},
                        "required": ["city"],
                    },
                },
            },
            {
                "type": "function",
                "function": {
                    "name": "search_docs",
                    "description": "Search the documentation.",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "query": {"type": "string"},
                            "top_k": {"type": "integer", "minimum": 1, "maximum": 20},
                        },
                        "required": ["query"],
                    },
                },
            },
        ]
    if stream:
        body["stream"] = True
    return body


TEXT_PROMPT = "### Instruction:\nWrite one short sentence about foxes.\n### Response:\n"


def offload_conversation(
    n_images: int, target_bytes: int, seed: int
) -> tuple[dict[str, Any], list[str], int]:
    """A chat request whose messages' compact JSON is about ``target_bytes`` with
    ``n_images`` JPEG images (structurally valid: SOI, JFIF, DQT, SOF0, DHT, SOS,
    incompressible entropy data, EOI) as base64 data URLs.

    Returns (body, image samples, compact JSON size). The samples are 48-character
    pieces from the middle of each image's base64, to look for in tokencount bodies.
    """
    rng = random.Random(seed)

    def segment(marker: int, payload: bytes) -> bytes:
        return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload

    def jpeg(size: int) -> bytes:
        head = b"\xff\xd8" + segment(0xE0, b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00")
        head += segment(0xDB, b"\x00" + bytes([16] * 64))
        head += segment(0xC0, struct.pack(">BHHB", 8, 1536, 2048, 3) + b"\x01\x11\x00\x02\x11\x00\x03\x11\x00")
        head += segment(0xC4, b"\x00" + bytes([0, 1, 5, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]) + bytes(range(12)))
        head += segment(0xC4, b"\x10" + bytes([0, 2, 1, 3, 3, 2, 4, 3, 5, 5, 4, 4, 0, 0, 1, 0x7D]) + bytes(range(162)))
        head += segment(0xDA, b"\x03\x01\x00\x02\x11\x03\x11\x00\x3f\x00")
        entropy = rng.randbytes(size - len(head) - 2).replace(b"\xff", b"\xfe")
        return head + entropy + b"\xff\xd9"

    text_messages: list[dict[str, Any]] = chat_body(20, tools=False)["messages"]
    text_bytes = len(json.dumps(text_messages, separators=(",", ":")))
    overhead = 120  # JSON around each image part
    per_image_b64 = (target_bytes - text_bytes - overhead * n_images) // n_images
    raw_size = per_image_b64 // 4 * 3 - 32
    samples = []
    messages = copy.deepcopy(text_messages)
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Compare these pictures, please."}]
    for _ in range(n_images):
        b64 = base64.b64encode(jpeg(raw_size)).decode("ascii")
        samples.append(b64[len(b64) // 2 : len(b64) // 2 + 48])
        parts.append({"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + b64}})
    messages[-1] = {"role": "user", "content": parts}
    body = {"messages": messages, "max_tokens": 128, "temperature": 0.7}
    decoded = len(json.dumps(messages, separators=(",", ":")).encode())
    return body, samples, decoded
