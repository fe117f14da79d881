"""Evaluation: prediction with ultralytics' NMS, scoring with pycocotools."""
