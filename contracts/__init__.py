"""The contract between the control plane and the data path.

What the control plane (Django) writes and the gateway reads: the read model's Redis keys,
records and encoding (``schema``), the change announcement (``publish``), the API key format
(``keyformat``), the sizing formulas both sides compute (``formulas``) and the development
defaults both sides must agree on (``defaults``). ``readmodel_writer`` writes the read model
without Django, for the tests and the benchmarks.

And what the gateway must compute exactly as the replicas do: the replica flags the platform
depends on (``replica_flags``), the prefix-cache block hashes (``blockhash``) and the emulated
model's prompt tokenizer (``tokenizer``) that cache-aware routing hashes; the emulated replica
imports the same modules, and the gateway never imports the emulator.

This package imports nothing from the gateway, the emulator, Django or the control-plane
apps (``make lint`` checks it with import-linter), so either side can depend on it.
"""
