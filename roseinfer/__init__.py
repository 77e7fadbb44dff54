"""roseinfer: generation with a KV cache, grown step by step and checked against the oracle."""
