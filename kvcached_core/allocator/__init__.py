"""The allocator an engine calls: page bookkeeping, placement, the prefix-cache ledger, compaction,
sleep, the background poller and the optional C alloc path."""
