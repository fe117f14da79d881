"""The detector shared by every stage: building the model, safe model files, prediction with ultralytics' NMS."""
