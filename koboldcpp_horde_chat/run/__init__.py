"""A job's life and its I/O: its owner, the chat and text runs, streaming, the
fit check, images, downloads and the submit."""
