"""Sinks: one module per format (Lance, Delta, MDS)."""
