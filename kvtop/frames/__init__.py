"""What every front end reads: a frame of the fleet (:mod:`.source`), the events between two frames
(:mod:`.events`) and the per-model history across them (:mod:`.history`). No textual here."""
