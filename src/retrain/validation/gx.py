"""Run rules with great-expectations: an ephemeral context, one pandas asset, suite and checkpoint per table.

Results are mapped back to rules through each expectation's ``meta``; the offending rows come from
great-expectations' own unexpected-index lists.  With ``docs_dir`` the Data Docs HTML site is built there.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pandas as pd

from retrain.validation.datadocs import localize
from retrain.validation.report import CheckResult
from retrain.validation.suite import Rule

log = logging.getLogger(__name__)


def _context(docs_dir: Path | None) -> Any:
    # great-expectations is imported here, not at the top: it takes seconds, and it reads GX_ANALYTICS_ENABLED then.
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")  # nothing leaves this machine
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    for name in list(logging.Logger.manager.loggerDict):  # GX sets INFO on its own loggers; not for our users
        if name.startswith("great_expectations") and not log.isEnabledFor(logging.DEBUG):
            logging.getLogger(name).setLevel(logging.WARNING)
    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    if docs_dir is not None:
        ctx.add_data_docs_site(site_name="retrain", site_config={
            "class_name": "SiteBuilder",
            "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(docs_dir)},
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
        })
    return ctx


def _examples(rule: Rule, df: pd.DataFrame, result: dict[str, Any], n: int) -> tuple[dict[str, Any], ...]:
    index = result.get("partial_unexpected_index_list") or result.get("unexpected_index_list") or []
    column = getattr(rule.expectation, "column", None)
    out = []
    for i in index[:n]:
        if isinstance(i, dict) or i not in df.index:
            continue
        row = df.loc[i]
        ex: dict[str, Any] = {"file": row.get(rule.file_column, ""), "batch": row.get("batch", "")}
        if column is not None and column in row:
            value = row[column].item() if hasattr(row[column], "item") else row[column]
            ex["found"] = f"{column}={value!r}"
        if "ann_id" in row and rule.table != "images":
            ex["found"] = f"annotation {row['ann_id']}: " + ex.get("found", "")
        out.append(ex)
    return tuple(out)


def _result(rule: Rule, er: Any, df: pd.DataFrame, examples: int) -> CheckResult:
    if er.exception_info and er.exception_info.get("raised_exception"):
        msg = er.exception_info.get("exception_message", "error")
        return CheckResult(rule.name, rule.table, f"{rule.what} (could not run: {msg})", "fail")
    res = er.result or {}
    return CheckResult(rule.name, rule.table, rule.what, "pass" if er.success else rule.level,
                       res.get("unexpected_count"), res.get("observed_value"),
                       () if er.success else _examples(rule, df, res, examples))


def run_rules(rules: list[Rule], tables: dict[str, pd.DataFrame], examples: int = 5,
              docs_dir: Path | None = None) -> list[CheckResult]:
    """Validate each table against its rules (GX's SUMMARY result format: counts and the first offending rows).

    Args:
        rules: The rules; those whose table is absent are skipped.
        tables: Table name -> DataFrame.
        examples: Offending rows kept per failed rule (at most 20).
        docs_dir: Where to build the Data Docs site, or ``None``.

    Returns:
        One result per rule, in the rules' order.
    """
    import great_expectations as gx  # after _context has set its environment (above)

    ctx = _context(docs_dir)
    source = ctx.data_sources.add_pandas("retrain")
    by_idx: dict[int, CheckResult] = {}
    for table, df in tables.items():
        mine = {i: r for i, r in enumerate(rules) if r.table == table}
        if not mine:
            continue
        suite = gx.ExpectationSuite(name=f"retrain-{table}")
        for i, r in mine.items():
            e = r.expectation  # rules are built fresh for each run, so the expectation is ours to annotate
            e.meta = {"retrain_index": i, "retrain_rule": r.name, "level": r.level, "notes": r.what}
            e.severity = "warning" if r.level == "warn" else "critical"  # Data Docs shows a warn rule as such
            suite.add_expectation(e)
        batch_definition = source.add_dataframe_asset(table).add_batch_definition_whole_dataframe(table)
        vd = ctx.validation_definitions.add(gx.ValidationDefinition(
            name=table, data=batch_definition, suite=ctx.suites.add(suite)))
        actions: list[Any] = [gx.checkpoint.UpdateDataDocsAction(name="data-docs")] if docs_dir is not None else []
        checkpoint = ctx.checkpoints.add(gx.Checkpoint(name=f"retrain-{table}", validation_definitions=[vd],
                                                       actions=actions, result_format={"result_format": "SUMMARY"}))
        run = checkpoint.run(batch_parameters={"dataframe": df})
        for vr in run.run_results.values():
            for er in vr.results:
                i = er.expectation_config.meta["retrain_index"]
                by_idx[i] = _result(mine[i], er, df, examples)
    if docs_dir is not None and (docs_dir / "index.html").is_file():
        localize(docs_dir)  # the pages load their scripts from CDNs: offline, the index would list nothing
    return [by_idx[i] for i in sorted(by_idx)]
