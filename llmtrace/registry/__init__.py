"""Layer registry: a model spec -> files on disk (models.toml, the cache and its manifests, hub and PyPI fetchers, resolve/pull). No torch."""
