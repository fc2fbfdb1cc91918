"""SSE decoding throughput (koboldcpp_horde_chat's SSEDecoder) on koboldcpp-shaped streams.

Recorded koboldcpp 1.116.1 streams, read one event at a time and in 4 KiB and
64 KiB pieces; MB/s, min / median / max over the runs. Target and method:
bench/README.md.
"""

from __future__ import annotations

import statistics
import sys
import time

from harness import ROOT
from harness.product import SSEDecoder
from harness.report import parser, reproduce

SAMPLES = ROOT / "tests" / "data" / "kcpp-samples"
NAMES = ("chat_stream.raw", "chat_stream_smollm.raw", "abort_chat_stream.raw")


def load_stream() -> bytes:
    parts = [(SAMPLES / n).read_bytes() for n in NAMES if (SAMPLES / n).exists()]
    if parts:
        return b"".join(parts)
    chunk = (
        b'data: {"id": "chatcmpl-A123456", "object": "chat.completion.chunk", '
        b'"created": 1795991072, "model": "koboldcpp/model", "choices": [{"index": 0, '
        b'"finish_reason": null, "delta": {"role": "assistant", "content": " caf\xc3\xa9"}}]}\n\n'
    )
    return chunk * 40 + b"data: [DONE]\n\n"


def by_event(stream: bytes) -> list[bytes]:
    return [p + b"\n\n" for p in stream.split(b"\n\n") if p]


def by_size(stream: bytes, size: int) -> list[bytes]:
    return [stream[i : i + size] for i in range(0, len(stream), size)]


def run(pieces: list[bytes]) -> tuple[float, int]:
    dec = SSEDecoder()
    feed = dec.feed
    n = 0
    t0 = time.perf_counter()
    for p in pieces:
        n += len(feed(p))
    dec.close()
    return time.perf_counter() - t0, n


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--mib", type=float, default=8.0)
    args = ap.parse_args()
    one = load_stream()
    reps = max(1, int(args.mib * 1024 * 1024 / len(one)))
    stream = one * reps
    total = len(stream)
    print(f"python {sys.version.split()[0]}; {total / 1e6:.1f} MB per run, {args.runs} runs")
    print(f"reproduce: {reproduce('bench_sse.py', f'--runs {args.runs} --mib {args.mib:g}')}")
    for label, pieces in (
        ("event", by_event(stream)),
        ("4KiB", by_size(stream, 4096)),
        ("64KiB", by_size(stream, 65536)),
    ):
        rates = []
        events = 0
        for _ in range(args.runs):
            dt, events = run(pieces)
            rates.append(total / dt / 1e6)
        print(
            f"{label:>6}: {len(pieces):7d} reads, {events:6d} events: MB/s "
            f"min {min(rates):7.1f}  median {statistics.median(rates):7.1f}  max {max(rates):7.1f}"
        )


if __name__ == "__main__":
    main()
