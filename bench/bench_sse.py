"""Throughput of koboldcpp_horde_chat.kcpp.sse.SSEDecoder on koboldcpp-shaped streams.

Reproduce (from the repository root):

    python bench/bench_sse.py [--runs 7] [--mib 8]

The input is the recorded koboldcpp 1.116.1 streams in tests/data/kcpp-samples/
(or a synthetic stream of the same shape when they are absent) repeated to about
``--mib`` MiB, fed to a fresh decoder in three ways:

* ``event``: one read per event, as koboldcpp writes them (about 250 bytes);
* ``4KiB`` and ``64KiB``: fixed-size reads that split lines, CR LF pairs and
  UTF-8 characters anywhere.

It prints MB/s (10**6 bytes per second) as min / median / max over the runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from koboldcpp_horde_chat.kcpp.sse import SSEDecoder  # noqa: E402

SAMPLES = Path(__file__).resolve().parents[1] / "tests" / "data" / "kcpp-samples"
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--mib", type=float, default=8.0)
    args = ap.parse_args()
    one = load_stream()
    reps = max(1, int(args.mib * 1024 * 1024 / len(one)))
    stream = one * reps
    total = len(stream)
    print(f"python {sys.version.split()[0]}; {total / 1e6:.1f} MB per run, {args.runs} runs")
    print(f"reproduce: python bench/bench_sse.py --runs {args.runs} --mib {args.mib:g}")
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
