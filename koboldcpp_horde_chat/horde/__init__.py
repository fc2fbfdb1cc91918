"""The Horde's side: its client, the declaration, pop parsing, submit bodies, progress."""
