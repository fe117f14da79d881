"""What the ``retrain`` command prints: its logging, and its exit policy.

Expected failures (``RetrainError``) print their lines as ``error: ...`` and exit with their code, without a
traceback; a full disk and an unreachable service are one line too (exit 1 and 75: the flow retries 75); anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from retrain.errors import RetrainError, TransientError, disk_full, transient_reason
from retrain.lifeline import ENV as DIE_WITH_PARENT
from retrain.lifeline import die_with_parent

#: Loggers whose INFO lines are not for our users (they stay at WARNING unless --verbose).
QUIET_LOGGERS = ("great_expectations", "matplotlib", "PIL", "httpx", "httpcore")


class RunFormatter(logging.Formatter):
    """Prefect's run loggers say which task or flow run a line is from; so does the terminal."""

    def format(self, record: logging.LogRecord) -> str:
        run = getattr(record, "task_run_name", None) or getattr(record, "flow_run_name", None)
        if run and record.name.startswith("prefect."):
            line = f"{record.levelname} {run}: {record.getMessage()}"
            return line + "\n" + self.formatException(record.exc_info) if record.exc_info else line
        return super().format(record)


def setup_logging(verbose: bool) -> None:
    """Log lines to stderr as ``LEVEL logger: message`` (INFO, or DEBUG with ``--verbose``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RunFormatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])
    for noisy in QUIET_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbose else logging.WARNING)


def run(app: Callable[[], object]) -> None:
    """Run the command line ``app`` under the exit policy above."""
    os.environ.setdefault("YOLO_OFFLINE", "true")  # ultralytics must never download weights or fonts
    if os.environ.get(DIE_WITH_PARENT) == "1":  # a stage the flow started (through DVC): see lifeline.py
        die_with_parent()
    try:
        app()
    except RetrainError as e:
        for line in e.lines():
            print(f"error: {line}", file=sys.stderr)
        sys.exit(e.exit_code)
    except Exception as e:  # a service down is one line and exit 75, which the flow retries; a bug keeps its traceback
        full = disk_full(e)
        if full is not None:
            print(f"error: {full}", file=sys.stderr)
            sys.exit(full.exit_code)
        reason = transient_reason(e)
        if reason is None:
            raise
        print(f"error: unavailable, try again later: {reason}", file=sys.stderr)
        sys.exit(TransientError.exit_code)
