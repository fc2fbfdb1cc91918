"""koboldcpp's side: its client, the seam it implements, its answers, SSE,
reasoning and local use. It knows nothing of the Horde."""
