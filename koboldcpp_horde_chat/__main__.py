"""``python -m koboldcpp_horde_chat``: the same as the ``koboldcpp-horde-chat`` command."""

from .cli import main

raise SystemExit(main())
