"""Serve AI Horde chat jobs from koboldcpp.

The package implements the text worker side of the Horde's chat protocol
("Serve chat jobs from a text worker") for koboldcpp: it declares chat on every
pop, serves chat jobs through koboldcpp's ``/v1/chat/completions`` and text jobs
through ``/api/v1/generate`` from one pop loop, and submits structured replies
or faults.
"""

__version__ = "0.1.0"
BRIDGE_AGENT = f"koboldcpp-horde-chat:{__version__}:https://pypi.org/project/koboldcpp-horde-chat/"
