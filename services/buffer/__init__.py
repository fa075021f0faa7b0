"""The data buffer service: datasets, prompt leases, the Redis-backed sample store and training batches."""
