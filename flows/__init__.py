"""Prefect flows that drive the retrain stages (the flow issue fills this package)."""
