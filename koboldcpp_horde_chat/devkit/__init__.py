"""Development servers for the chat worker protocol: tests, the demo, other workers.

* :mod:`koboldcpp_horde_chat.devkit.horde`: :class:`DevHorde`, a local Horde with
  the chat worker routes (pop, submit, progress), the seed's declaration checks,
  eligibility rules, refusals and streaming progress contract, plus a storage
  port for offloaded messages and image URLs.
* :mod:`koboldcpp_horde_chat.devkit.kcpp`: :class:`ScriptedKoboldcpp`, a scripted
  koboldcpp 1.116.1 answering its routes with canned, deterministic replies.
* :mod:`koboldcpp_horde_chat.devkit._http`: the small threaded JSON HTTP server
  the dev Horde's two ports are built on.

The devkit never imports the worker's modules: it implements the Horde's side of
the rules on its own, so tests do not check the worker against itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from koboldcpp_horde_chat.devkit.horde import DevHorde

__all__ = ["DevHorde"]


def __getattr__(name: str) -> Any:
    """Import :class:`DevHorde` lazily, so ``devkit._http`` loads on its own."""
    if name == "DevHorde":
        from koboldcpp_horde_chat.devkit.horde import DevHorde

        return DevHorde
    raise AttributeError(name)
