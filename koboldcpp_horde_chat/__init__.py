"""Serve AI Horde chat jobs from koboldcpp.

The package implements the text worker side of the Horde's chat protocol
("Serve chat jobs from a text worker") for koboldcpp: it declares chat on every
pop, serves chat jobs through koboldcpp's ``/v1/chat/completions`` and text jobs
through ``/api/v1/generate`` from one pop loop, and submits structured replies
or faults.
"""

__version__ = "0.2.0.dev0"
# The pop's bridge agent, "<name>:<version>:<free text>". The Horde reads the name
# before the first colon and sends text requests that keep its default
# ``validated_backends: true`` only to workers whose name it lists as a validated
# backend (and pays the others 0.3 x the kudos). The worker is koboldcpp's embedded
# Horde worker, so it sends koboldcpp's name and version field (koboldcpp itself
# sends "KoboldCppEmbedWorker:2:https://github.com/LostRuins/koboldcpp"); the free
# text names this package and its version alone (it has no web page to name), so
# the Horde's operators can tell the two apart.
BRIDGE_AGENT = f"KoboldCppEmbedWorker:2:koboldcpp-horde-chat {__version__}"
