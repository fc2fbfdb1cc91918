"""The entry point koboldcpp's patch imports; it never moves.

Every koboldcpp patch this package has shipped (``patches/``) adds, at the
top of koboldcpp's ``run_horde_worker``::

    from koboldcpp_horde_chat import kcpp_hook
    kcpp_hook.run_horde_worker(sys.modules[__name__], args, api_key, worker_name,
                               worker_id, parallel_batching_threads)

The patches of 0.2.0 onwards also call :func:`start_recovery` early in
koboldcpp's start-up, before the model loads, in a guarded block of its own.

A koboldcpp patched once keeps serving through this module after any upgrade
of the package: this module, its name and :func:`run_horde_worker`'s
signature stay the same in every version, whatever moves inside the package.
When what a patch imports has to change, the package's version changes with
it, the patches' headers name the version they need, and this module keeps
the old path working.

Import paths the patches have used, all kept:

- ``koboldcpp_horde_chat.kcpp_hook`` (this module): the patches of 0.1.0 and
  of 0.2.0 onwards;
- ``koboldcpp_horde_chat.kcpp.hook`` (now a module that forwards, like this
  one): the patches of the development tree between 0.1.0 and 0.2.0.dev0.

The hook itself is :mod:`koboldcpp_horde_chat.hosts.inside_kcpp`.
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
    """Serve Horde chat and text jobs in this koboldcpp worker thread until koboldcpp stops.

    The patched ``run_horde_worker`` of ``koboldcpp.py`` calls it with koboldcpp's module
    and its own arguments; it runs :func:`koboldcpp_horde_chat.hosts.inside_kcpp.run_horde_worker`,
    which blocks until koboldcpp shuts down and never raises (errors are logged).
    """
    inside_kcpp.run_horde_worker(
        kcpp, args, api_key, worker_name, worker_id, parallel_batching_threads
    )


def start_recovery(kcpp: types.ModuleType, args: object) -> bool:
    """End the jobs the last run left in hand as soon as the Horde answers, before
    koboldcpp loads its model (since 0.2.0).

    The patches of 0.2.0 onwards call it early in koboldcpp's start-up, once
    ``args`` is read, as ``start_recovery(sys.modules[__name__], args)``,
    guarded so that a package without it changes nothing (the first
    :func:`run_horde_worker` call then starts the recovery, as in 0.1.0). It
    runs :func:`koboldcpp_horde_chat.hosts.inside_kcpp.start_recovery`: True when a
    recovery started now; never raises.
    """
    return inside_kcpp.start_recovery(kcpp, args)


__all__ = ["run_horde_worker", "start_recovery"]
