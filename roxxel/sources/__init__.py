"""Loader sources over a dataset: whole records (``records``) or token windows (``windows``)."""
