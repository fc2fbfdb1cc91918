"""Serve AI Horde chat jobs (and text jobs) from koboldcpp, from one pop loop."""

__version__ = "0.2.0.dev0"
# The pop's bridge agent. The Horde sends most text requests only to validated
# backends, named before the first colon, so the worker sends koboldcpp's own
# name and version field; the free text tells this package apart.
BRIDGE_AGENT = f"KoboldCppEmbedWorker:2:koboldcpp-horde-chat {__version__}"
