"""Prefect flows (the only place besides ``tasks/`` that imports Prefect)."""
