"""Between the two sides, pure: a popped job made koboldcpp's request body, the
fit check, images made data URLs, koboldcpp's chat stream accumulated, and
koboldcpp's answer made the Horde's structured submit."""
