"""Serving over HTTP: the Prometheus exporter (:mod:`.exporter`, its pages through :mod:`.http_page`), the
router (:mod:`.router`, ``kvctl route``), and how both listen (:mod:`.aioserve`). Never imports the screen."""
