"""Whether and where a request runs: the admission controller, its pure policy, the quota
scripts and leases in Redis, the replica registry and the router."""
