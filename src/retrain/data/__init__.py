"""Datasets: batch formats, ingest, merge, sample data."""
