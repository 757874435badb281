"""Prefect tasks: one module per pipeline stage, each a thin wrapper over :func:`tasks._dvc.run_stage`."""
