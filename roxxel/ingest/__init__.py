"""``roxxel pack``'s engine: input formats (one module each, behind a registry), work units,
the pack of one unit, the worker pool, and the on-disk pack state (``parts``)."""
