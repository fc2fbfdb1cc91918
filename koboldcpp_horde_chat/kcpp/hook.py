"""An import path earlier koboldcpp patches used; it forwards to the hook.

The hook lives in :mod:`koboldcpp_horde_chat.hosts.inside_kcpp`.

The patches of the development tree between 0.1.0 and 0.2.0.dev0 run, at the
top of koboldcpp's ``run_horde_worker``::

    from koboldcpp_horde_chat.kcpp import hook as kcpp_hook
    kcpp_hook.run_horde_worker(sys.modules[__name__], args, api_key, worker_name,
                               worker_id, parallel_batching_threads)

This module keeps that path and :func:`run_horde_worker`'s signature, and
holds nothing else: a koboldcpp patched with one of them keeps serving. The
patches of ``patches/`` import :mod:`koboldcpp_horde_chat.kcpp_hook`.
"""

from __future__ import annotations

import types

from ..hosts import inside_kcpp


def run_horde_worker(
    kcpp: types.ModuleType,
    args: object,
    api_key: str,
    worker_name: str,
    worker_id: int,
    parallel_batching_threads: int,
) -> None:
    """Serve Horde chat and text jobs in this koboldcpp worker thread until koboldcpp stops.

    Runs :func:`koboldcpp_horde_chat.hosts.inside_kcpp.run_horde_worker`, which
    blocks until koboldcpp shuts down and never raises (errors are logged).
    """
    inside_kcpp.run_horde_worker(
        kcpp, args, api_key, worker_name, worker_id, parallel_batching_threads
    )


__all__ = ["run_horde_worker"]
