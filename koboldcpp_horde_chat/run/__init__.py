"""A job's run and its I/O: the chat and text runs, streaming, downloads and
the submit pipeline."""
