"""The fleet as the server sees it in Redis: the fleet config, machines, reservations, queues,
the fleet lock, residency facts, costs, the journal pairing, status."""
