"""``kvtop --replay``: a recording played back through the dashboard (:mod:`.app`), its frames and events
read at any moment (:mod:`.source`)."""
