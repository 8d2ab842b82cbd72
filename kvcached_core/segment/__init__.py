"""The shared-memory segment: its byte layout, the allocator's writer, the lock-free reader, the
snapshots and decoded page maps readers get, and the file and process checks around them."""
