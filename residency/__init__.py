"""Residency: which models stay loaded on a worker, by a policy that follows the hardware."""
