"""What the benchmarks share; each ``bench/*.py`` script keeps only its own measurement.

Importing the package puts the package under test first on ``sys.path``: the
repository's ``koboldcpp_horde_chat``, or the one in ``$BENCH_PKG_ROOT``; the
repository stays on it too (``soak.py`` uses ``tests/fakes.py``, ``bench_stop.py``
the worker process of ``tests/integration/worker_process.py``).

* ``product``: every module of ``koboldcpp_horde_chat`` the benchmarks use
  (the devkit aside), imported there and nowhere else;
* ``devkit``: the dev Horde (timed) and the scripted koboldcpp;
* ``report``: figures, the machine line, printing, JSON, reproduce commands;
* ``servers``: the dev Horde and the scripted koboldcpp in a process of their own;
* ``timed_worker``: the worker as ``koboldcpp-horde-chat`` builds it, with timed clients;
* ``timing``: the worker's own time and the idle gap from the timed calls;
* ``bodies``: the requests the benchmarks queue;
* ``real_kcpp``: a real koboldcpp: where it is, how it is started and stopped.

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
