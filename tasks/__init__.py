"""Thin Prefect task wrappers around the stages (retries, timeouts, artifacts)."""
