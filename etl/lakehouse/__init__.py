"""The curated Lance table as a lakehouse: scalar and vector indexes, feature columns
added without rewriting image data, versions, compaction with retention, semantic
search. Modules: :mod:`indexes`, :mod:`features`, :mod:`embeddings`, :mod:`maintenance`.
"""
