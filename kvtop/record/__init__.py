"""Recording: ``kvctl record`` writes every model's counters, page maps and events to SQLite day files;
:mod:`kvtop.record.reading` reads any moment back (``kvtop --replay``, ``kvctl report``). No textual here."""
