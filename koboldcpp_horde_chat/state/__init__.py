"""A job's state and what the worker knows: the phase table, the job's owner,
what the worker's loops share, the maintenance guard, the lease fit, status
lines and the journal."""
