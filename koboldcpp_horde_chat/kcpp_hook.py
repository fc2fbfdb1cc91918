"""The entry point koboldcpp's patches import; its name and signatures never change.

Every shipped patch (``patches/``) adds, at the top of koboldcpp's
``run_horde_worker``::

    from koboldcpp_horde_chat import kcpp_hook
    kcpp_hook.run_horde_worker(sys.modules[__name__], args, api_key, worker_name,
                               worker_id, parallel_batching_threads)

and the patches of 0.2.0 onwards also call :func:`start_recovery` early in
koboldcpp's start-up, in a guarded block of its own. Keeping this module
stable lets a koboldcpp patched once serve after any upgrade of the package.
"""

from __future__ import annotations

import types

from .hosts import inside_kcpp


def run_horde_worker(
    kcpp: types.ModuleType,
    args: object,
    api_key: str,
    worker_name: str,
    worker_id: int,
    parallel_batching_threads: int,
) -> None:
    """Serve Horde jobs in this koboldcpp worker thread until koboldcpp stops; never raises."""
    inside_kcpp.run_horde_worker(
        kcpp, args, api_key, worker_name, worker_id, parallel_batching_threads
    )


def start_recovery(kcpp: types.ModuleType, args: object) -> bool:
    """End the jobs the last run left unfinished before the model loads (since 0.2.0).

    True when a recovery started now; never raises.
    """
    return inside_kcpp.start_recovery(kcpp, args)


__all__ = ["run_horde_worker", "start_recovery"]
