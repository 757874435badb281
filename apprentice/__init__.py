"""Apprentice: a teacher->student pipeline for multi-turn, tool-using LLM agents (README.md)."""
