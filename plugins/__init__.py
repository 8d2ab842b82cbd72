"""Engine plugins for kvcached_core, one package per engine, listed through the ``kvcached.engines`` entry points."""
