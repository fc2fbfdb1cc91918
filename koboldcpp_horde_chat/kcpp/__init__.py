"""An import path earlier koboldcpp patches used (see :mod:`koboldcpp_horde_chat.kcpp.hook`).

Only the forwarding entry point lives here; koboldcpp's side of the worker is
:mod:`koboldcpp_horde_chat.koboldcpp`.
"""
