"""The live dashboard: the app (:mod:`.dashboard`), its key table (:mod:`.actions`), its widgets, and
what it draws as rich renderables (:mod:`.view`), which ``kvtop --once`` (:mod:`.once`) prints without textual."""
