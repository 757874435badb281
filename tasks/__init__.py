"""Prefect tasks: one per registered stage (:func:`tasks.stages.stage_task`, a thin wrapper over
:func:`tasks._dvc.run_stage`), and the Ray-parallel runner of independent DVC stages (:mod:`tasks.parallel`)."""
