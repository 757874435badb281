"""One module per pipeline stage, each with ``run(cfg, paths, **kw) -> dict`` (registry: apprentice/pipeline.py)."""
