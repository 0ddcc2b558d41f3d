"""Talking to the replicas: the HTTP client, the stream relay to the client, and the exchange
that drives one request from dispatch to its usage event."""
