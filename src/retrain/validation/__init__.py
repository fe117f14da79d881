"""Validation: great-expectations table checks, image checks, and the report that gates training."""
