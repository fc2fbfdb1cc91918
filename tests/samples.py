"""Where the test data lives: responses recorded from a real koboldcpp 1.116.1
(``data/kcpp-samples``, see its README.md) and real chat requests from the
Berkeley Function Calling Leaderboard (``data/bfcl``, Apache-2.0, see its README.md)."""

from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
SAMPLES = DATA / "kcpp-samples"
BFCL = DATA / "bfcl" / "bfcl-chat-requests.jsonl"
