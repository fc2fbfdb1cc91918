"""Between the two sides, pure: koboldcpp's request bodies, the fit check, images,
the chat stream, and the Horde's submits."""
