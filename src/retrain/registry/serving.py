"""MLflow models-from-code entry point of a registered retrain detector (logged as the model's code)."""

from mlflow.models import set_model

from retrain.registry.pyfunc import DetectorModel

set_model(DetectorModel())
