"""The allocator's event log: append-only, hash-chained, replayed and audited."""
