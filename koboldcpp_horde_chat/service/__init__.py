"""The worker as a service: the pop loop, the pop gate, the pop beside the
submit, backoff and the start-up recovery."""
