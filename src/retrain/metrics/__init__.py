"""Scoring with pycocotools (COCOeval), per class and per slice, and the paired bootstrap of a difference."""
