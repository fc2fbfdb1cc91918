"""What the benchmarks share; each ``bench/*.py`` script keeps only its own measurement.

Importing the package puts the package under test first on ``sys.path``: the
repository's ``koboldcpp_horde_chat``, or the one in ``$BENCH_PKG_ROOT``; the
repository stays on it too. The benchmarks import nothing from ``tests/``; the
tests import the three modules here they share with the benchmarks (``fakes``,
``worker_process``, ``real_horde``).

* ``product``: every module of ``koboldcpp_horde_chat`` the benchmarks use
  (the devkit aside), imported there and nowhere else;
* ``devkit``: the dev Horde (timed) and the scripted koboldcpp;
* ``report``: figures, the machine line, printing, JSON, reproduce commands;
* ``servers``: the dev Horde and the scripted koboldcpp in a process of their own;
* ``timed_worker``: the worker as ``koboldcpp-horde-chat`` builds it, with timed clients;
* ``timing``: the worker's own time and the idle gap from the timed calls;
* ``bodies``: the requests the benchmarks queue;
* ``real_kcpp``: a real koboldcpp: where it is, how it is started and stopped;
* ``fakes``: in-process fakes of the worker's seams and a fake clock (the soak,
  the route's trace, and the tests' property tests);
* ``worker_process``: the standalone worker as a process, its log lines read as
  they come (``bench_stop.py`` and the tests that run it as a supervisor would).
* ``real_horde``: the real AI Horde server from a source checkout
  (``$AI_HORDE_SRC``) with its PostgreSQL and redis, on 127.0.0.1 (the tests
  marked ``real_horde`` and ``bench_kudos.py --real-horde``).

See bench/README.md for what is measured and how.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
#: BENCH_PKG_ROOT=<dir holding a koboldcpp_horde_chat copy> benchmarks that copy instead.
PKG_ROOT = Path(os.environ.get("BENCH_PKG_ROOT") or ROOT)
if str(PKG_ROOT) not in sys.path:
    sys.path.insert(0, str(PKG_ROOT))
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
