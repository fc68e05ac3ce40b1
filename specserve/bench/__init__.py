"""Serving benchmark client: `specserve bench serve` and `specserve bench compare`."""
