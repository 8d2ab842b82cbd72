"""The controller's side: ask a model for a limit, a trim, a sleep or a compaction and wait for its answer."""
