"""lakeshard: image-caption sources -> curated Lance table -> MDS shards."""

__version__ = "0.1.0"
