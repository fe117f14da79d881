"""A workspace with no batch yet: ``dvc repro`` and the flow end cleanly, saying there is nothing to train.

A weekly deployment or a ``dvc repro`` often runs before the first delivery.  The flow then ends at once
(``Completed``, "nothing to retrain: no batch yet").  ``dvc repro`` has no way to stop a pipeline early without
failing, so each stage records that state in the outputs ``dvc.yaml`` declares for it: merge writes the empty
master and prints the one line; validate, audit, train, evaluate and promote each write their outputs as ``{"no_data":
true}`` records and print nothing.  DVC then has a complete, up-to-date pipeline, and the first ingested batch makes
every stage stale again.  Only "no batch admitted" counts: a master that is empty while batches exist is stale (run
merge), and the stages still refuse it.
"""

from __future__ import annotations

from retrain.fsutil import dumps_canonical, write_atomic
from retrain.paths import Paths
from retrain.reports import NoData

HOW = "add one with 'retrain ingest DIR' (or put it in data/incoming/ and run 'retrain run')"
NOTHING_YET = f"nothing to train yet: no batch has been ingested; {HOW}"
REASON = "no batch has been ingested yet"
_RECORD = dumps_canonical(NoData(reason=REASON).to_json())  # what Report.read refuses, and Report.find skips
_PAGE = f"<!doctype html><title>retrain: no data</title><p>{REASON}: nothing was {{what}}.</p>\n"


def no_batch_yet(paths: Paths) -> bool:
    """True when ``data/batches`` holds no admitted batch (no ``<name>.dvc`` file)."""
    return not paths.batches.is_dir() or not any(paths.batches.glob("*.dvc"))


def record(paths: Paths, stage: str) -> None:
    """Write ``stage``'s declared outputs as "no data yet" records (validate, audit, train, evaluate, promote).

    Args:
        paths: The workspace (with no batch).
        stage: The stage whose outputs to write.
    """
    if stage == "validate":
        write_atomic(paths.validation_report, _RECORD)
        write_atomic(paths.validation_verdict, _RECORD)  # train's dependency; says nothing passed
        write_atomic(paths.validation_docs / "index.html", _PAGE.format(what="validated"))
    elif stage == "audit":
        write_atomic(paths.audit_report, _RECORD)
        write_atomic(paths.audit_pass, _RECORD)  # train's dependency; says nothing was audited
        write_atomic(paths.audit_page / "index.html", _PAGE.format(what="audited"))
    elif stage == "train":
        write_atomic(paths.train_report, _RECORD)
        write_atomic(paths.train_metrics, "epoch\n")
        write_atomic(paths.candidate / "README.txt", f"no candidate: {REASON}\n")
    elif stage == "evaluate":
        write_atomic(paths.eval_report, _RECORD)
        write_atomic(paths.eval_markdown, f"# Evaluation\n\nNothing to evaluate: {REASON}.\n")
        write_atomic(paths.eval_plots / "README.txt", f"no plots: {REASON}\n")
    elif stage == "promote":
        write_atomic(paths.promotion_report, _RECORD)
    else:
        raise ValueError(f"no 'no data' record for stage {stage}")
