"""The two hosts of the worker: standalone beside a running koboldcpp, and
inside koboldcpp (what the patches in ``patches/`` run); what both do before
their loops pop."""
