"""Who is calling: API key authentication against the gateway's cache of the read model the
control plane pushes to Redis."""
