"""Text shared by kvctl and the screen: tables and human figures (:mod:`.textfmt`), page-map glyphs (:mod:`.pagemap`)."""
