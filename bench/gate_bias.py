"""How often the gate promotes a candidate that is not better: the val split as judge against the test split.

The val split picks the candidate's best checkpoint (and early stopping, EMA or raw); judging the candidate on the
same images flatters it, and the flattery alone can meet ``promote.min_delta``.  This benchmark measures that.

Per data set: a champion is trained from scratch (seed 0).  Then, for each of N seeds, two candidates that are not
better are trained and judged against it:

- **rerun**: the champion's own recipe re-run with another seed (equal in expectation);
- **weaker**: the same recipe with a third of the epochs (worse by construction).

Each candidate and the champion are scored by ``retrain evaluate``'s code on the val and the test split of the same
master; the gate (``promotion.gate.decide``, with the params' ``min_delta``, forgetting guard and size guard off)
decides once with val as judge and once with test as judge.  Reported: the pass rate of each judge per kind, and
the val-vs-test gap of mAP50-95 (candidate val minus candidate test, and the same for the champion: the val
split's optimism is the candidate's gap minus the champion's).

A second part trains on a data set of near-copies (``generate_scenes``: frames of moving scenes and re-encoded
copies) twice, with near-copy groups on and off, and reports val and test mAP50-95 of each: without groups, val
holds frames of the scenes training saw.

Writes a section into bench/RESULTS.md.  Usage:
    python bench/gate_bias.py [--seeds 10] [--epochs 40] [--imgsz 160] [--batch 8] [--data sample|coco128|both]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
os.environ.setdefault("YOLO_OFFLINE", "true")
os.environ.setdefault("DO_NOT_TRACK", "1")
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from common import coco128_batches, machine, update_results_md  # noqa: E402

from retrain import runner  # noqa: E402
from retrain.config import Params, load_params  # noqa: E402
from retrain.detector.registered import RegisteredModel  # noqa: E402
from retrain.evaluation.evaluate import evaluate_models  # noqa: E402
from retrain.paths import Paths  # noqa: E402
from retrain.promotion.gate import ModelMetrics, decide  # noqa: E402
from retrain.training.train import train  # noqa: E402
from retrain.workspace import init_workspace, set_params  # noqa: E402


def _params(paths: Paths) -> Params:
    return load_params(paths.root / "params.yaml")


def _workspace(base: Path, batches: list[Path], merge: dict[str, Any], train: dict[str, Any]) -> Paths:
    paths = init_workspace(base / "ws", remote=str(base / "remote"))
    set_params(paths, {**{f"merge.{k}": v for k, v in merge.items()},
                       **{f"train.{k}": v for k, v in train.items()},
                       "runtime.workers": 0, "runtime.cache": "ram", "evaluate.bootstrap": 50,
                       "validate.instances_level": "warn", "validate.val_fraction_level": "warn"})
    for b in batches:
        runner.run_ingest(paths, _params(paths), b, None, "auto")
    runner.run_merge(paths, _params(paths))
    list(runner.run_validate(paths, _params(paths)))
    return paths


def _train(paths: Paths, **train_params: Any) -> tuple[Path, float]:
    set_params(paths, {f"train.{k}": v for k, v in train_params.items()})
    params = _params(paths)
    t0 = time.perf_counter()
    result = train(paths, params, None, runner.run_log(paths, params))
    assert result is not None
    return result.candidate, time.perf_counter() - t0


def _view(per_class: dict[str, float], overall: float, instances: dict[str, int]) -> ModelMetrics:
    return ModelMetrics(overall, per_class, {}, instances)


def _judge(paths: Paths, champion: Path) -> dict[str, Any]:
    """Evaluate the candidate in models/candidate against ``champion``; the gate's verdict with each judge."""
    params = _params(paths)
    report = evaluate_models(paths, params, RegisteredModel("bench", "0", champion))
    assert report.champion is not None and report.val is not None and report.val.champion is not None
    from retrain.data.master import load_master

    master = load_master(paths.master, paths.data)
    names = {c["id"]: c["name"] for c in master.doc["categories"]}
    val_ids = {im["id"] for im in master.images("val")}
    val_instances = {n: 0 for n in names.values()}
    for a in master.doc["annotations"]:
        if a["image_id"] in val_ids:
            val_instances[names[a["category_id"]]] += 1
    test = decide(_view(report.champion.metrics.per_class, report.champion.metrics.map, report.instances),
                  _view(report.candidate.metrics.per_class, report.candidate.metrics.map, report.instances),
                  params.promote)
    val = decide(_view(report.val.champion.per_class, report.val.champion.map, val_instances),
                 _view(report.val.candidate.per_class, report.val.candidate.map, val_instances), params.promote)
    assert report.delta is not None
    lo, hi = report.delta.ci
    # The paired bootstrap's spread of the test delta: with a candidate exactly as good as the champion, the
    # delta still reaches min_delta with probability 1 - Phi(min_delta / sd) (what min_delta implies).
    sd = max((hi - lo) / (2 * statistics.NormalDist().inv_cdf(0.5 + report.delta.confidence / 2)), 1e-9)
    implied = 1 - statistics.NormalDist().cdf(params.promote.min_delta / sd)
    return {"test_pass": test.promote, "val_pass": val.promote, "implied": implied,
            "cand_test": report.candidate.metrics.map, "cand_val": report.val.candidate.map,
            "champ_test": report.champion.metrics.map, "champ_val": report.val.champion.map}


def sample_batches(base: Path) -> list[Path]:
    from retrain.data.sample import generate

    return [b.path for b in generate(base / "samples", batches=3, images_per_batch=60, seed=0)]


def gate_runs(name: str, batches: list[Path], base: Path, seeds: int, epochs: int, imgsz: int,
              batch: int) -> dict[str, Any]:
    recipe = {"imgsz": imgsz, "epochs": epochs, "batch": batch, "use_champion": False, "base_model": "",
              "eval_interval": 1, "patience": epochs, "lr": 0.004, "augment": {"close_mosaic": max(1, epochs // 4)}}
    paths = _workspace(base / name, batches, {}, recipe)
    champion_file, champion_s = _train(paths, seed=0)
    champion = base / name / "champion.pt"
    champion.write_bytes(champion_file.read_bytes())
    rows: dict[str, list[dict[str, Any]]] = {"rerun": [], "weaker": []}
    for seed in range(1, seeds + 1):
        for kind, eps in (("rerun", epochs), ("weaker", max(1, epochs // 3))):
            _, seconds = _train(paths, seed=seed, epochs=eps, augment={"close_mosaic": max(1, eps // 4)})
            row = _judge(paths, champion) | {"seed": seed, "seconds": seconds}
            rows[kind].append(row)
            print(f"{name} {kind} seed {seed}: val {row['cand_val']:.4f} vs {row['champ_val']:.4f} "
                  f"({'pass' if row['val_pass'] else 'reject'}), test {row['cand_test']:.4f} vs "
                  f"{row['champ_test']:.4f} ({'pass' if row['test_pass'] else 'reject'})", flush=True)
    master = _params(paths)
    return {"name": name, "rows": rows, "champion_seconds": champion_s, "min_delta": master.promote.min_delta,
            "splits": _split_counts(paths)}


def _split_counts(paths: Paths) -> str:
    from retrain.data.master import load_master

    m = load_master(paths.master, paths.data)
    return "/".join(str(len(m.images(s))) for s in ("train", "val", "test"))


def near_copy_runs(base: Path, epochs: int, imgsz: int, batch: int) -> list[dict[str, Any]]:
    from retrain.data.sample import generate_scenes

    scenes = generate_scenes(base / "scenes-data" / "batch-1", scenes=24, frames=8, seed=5, copies=2).path
    out = []
    for label, distance in (("groups on", 40), ("groups off", -1)):
        recipe = {"imgsz": imgsz, "epochs": epochs, "batch": batch, "use_champion": False, "base_model": "",
                  "eval_interval": 1, "patience": epochs, "lr": 0.004, "seed": 0,
                  "augment": {"close_mosaic": max(1, epochs // 4)}}
        paths = _workspace(base / f"scenes-{distance}", [scenes], {"near_duplicate_distance": distance}, recipe)
        _train(paths)
        report = evaluate_models(paths, _params(paths), None)
        assert report.val is not None
        out.append({"label": label, "val": report.val.candidate.map, "test": report.candidate.metrics.map,
                    "splits": _split_counts(paths)})
        print(f"near copies, {label}: val {out[-1]['val']:.4f}, test {out[-1]['test']:.4f}", flush=True)
    return out


ABOUT = (
    "yolo11n from scratch; the champion is seed 0; each seed adds a **rerun** (the champion's recipe, another "
    "seed: not better in expectation) and a **weaker** candidate (a third of the epochs). Both judged against the "
    "champion on the same master by the gate (`min_delta` as in params, forgetting guard on, `min_class_instances` "
    "as in params), once on val (which picked each candidate's best epoch) and once on test (which nothing looked "
    "at). The implied rate: with a candidate exactly as good as the champion, the test delta still reaches "
    "`min_delta` with probability 1 - Phi(min_delta / sd), sd from each evaluation's paired bootstrap. The val "
    "split's optimism is the mean val - test gap of the models it selected.")


def _rate(rows: list[dict[str, Any]], key: str) -> str:
    n = sum(r[key] for r in rows)
    return f"{n}/{len(rows)} ({n / len(rows):.0%})"


def section(results: list[dict[str, Any]], copies: list[dict[str, Any]], args: argparse.Namespace,
            wall: float) -> str:
    lines = [
        "## gate_bias: does a candidate that is not better pass the gate, with val or test as judge?", "",
        f"Machine: {machine()}. Run: `python bench/gate_bias.py --seeds {args.seeds} --epochs {args.epochs} "
        f"--imgsz {args.imgsz} --batch {args.batch} --data {args.data}` ({wall / 60:.0f} min). " + ABOUT, "",
        "| data (train/val/test images) | candidate | passes, val judge | passes, test judge | rate min_delta "
        "implies for an equal candidate (test) | mean val - test mAP50-95, candidate | mean val - test, champion |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        for kind, rows in res["rows"].items():
            cgap = statistics.mean(r["cand_val"] - r["cand_test"] for r in rows)
            hgap = statistics.mean(r["champ_val"] - r["champ_test"] for r in rows)
            implied = statistics.mean(r["implied"] for r in rows)
            lines.append(f"| {res['name']} ({res['splits']}) | {kind} | {_rate(rows, 'val_pass')} | "
                         f"{_rate(rows, 'test_pass')} | {implied:.0%} | {cgap:+.4f} | {hgap:+.4f} |")
    lines += ["", "Per seed (candidate mAP50-95 on val / test; the champion's is the same in every row of a data "
              "set):", ""]
    for res in results:
        r0 = res["rows"]["rerun"][0]
        lines.append(f"- {res['name']}: champion val {r0['champ_val']:.4f}, test {r0['champ_test']:.4f}; "
                     + "; ".join(f"{kind} " + ", ".join(f"{r['cand_val']:.3f}/{r['cand_test']:.3f}" for r in rows)
                                 for kind, rows in res["rows"].items()))
    if copies:
        lines += ["", "Near-copies (`generate_scenes`: 24 scenes x 8 frames of moving shapes, 2 re-encoded copies "
                  "each; one model per row, same recipe):", "",
                  "| near-copy groups | train/val/test images | val mAP50-95 | test mAP50-95 | val - test |",
                  "|---|---|---:|---:|---:|"]
        for c in copies:
            lines.append(f"| {c['label']} | {c['splits']} | {c['val']:.4f} | {c['test']:.4f} | "
                         f"{c['val'] - c['test']:+.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--imgsz", type=int, default=160)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--data", choices=("sample", "coco128", "both"), default="sample")
    ap.add_argument("--no-near-copies", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    base = Path(tempfile.mkdtemp(prefix="gate-bias-"))
    results = []
    if args.data in ("sample", "both"):
        results.append(gate_runs("sample", sample_batches(base), base, args.seeds, args.epochs, args.imgsz,
                                 args.batch))
    if args.data in ("coco128", "both"):
        results.append(gate_runs("coco128", coco128_batches(base, 3), base, args.seeds, args.epochs, args.imgsz,
                                 args.batch))
    copies = [] if args.no_near_copies else near_copy_runs(base, args.epochs, args.imgsz, args.batch)
    text = section(results, copies, args, time.perf_counter() - t0)
    update_results_md(text)
    print(text)


if __name__ == "__main__":
    main()
