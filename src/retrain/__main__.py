"""``python -m retrain``: the same as the ``retrain`` command."""

from retrain.cli import main

main()
