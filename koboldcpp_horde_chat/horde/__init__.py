"""The Horde's side: its client, the seam it implements, the declaration, pop
parsing, progress and return codes. It knows nothing of koboldcpp."""
