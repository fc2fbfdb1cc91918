"""The worker as a service: the pop loop, shared state, the maintenance guard,
backoff, the journal, status lines and the standalone host."""
