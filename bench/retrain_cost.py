"""What a weekly retrain costs, and what it keeps: three training policies over six weekly batches.

Six batches arrive one a week (sample data: three shapes on gradients in weeks 1-2, a new class, ``star``, on striped
backgrounds from week 3, noisy backgrounds from week 5; or coco128 split into six batches).  Week 1's model, trained
from scratch for ``--champion-epochs`` times the schedule (a champion that knows its data, as a team's has after a
first training), is every policy's first champion.  Then each week, side by side on the same master:

- **(a) scratch**: from scratch on the whole master (``use_champion: false``);
- **(b) warm, full**: warm start from the policy's champion, the full schedule, every image every epoch
  (``warm: off``, ``replay: off``: the behaviour before ``train.warm`` and ``train.replay``);
- **(c) warm + replay**: warm start, ``train.warm``'s schedule and ``train.replay``'s sampling, as params.yaml has them.

Each candidate is timed (the whole ``retrain train`` stage in this process: loading, fit, scoring, export), scored by
``retrain evaluate``'s code against its own policy's champion on the test split (overall, per class, per origin
batch: the same images for all three), and judged by the gate (``promotion.gate.decide``, params as they are); a
promoted candidate becomes that policy's champion.  Writes a section and a plot (``bench/retrain_cost.png``) into
bench/RESULTS.md.  Usage:

    python bench/retrain_cost.py [--data sample|coco128] [--first 60] [--images 24] [--epochs 40]
                                 [--champion-epochs 3] [--imgsz 160] [--batch 8]

Each workspace times a training step in NCHW and channels_last once per model (``train.channels_last: auto``) and the
two formats' arithmetic differs, so two runs' week-1 champions differ; ``result.json`` records the choices, and a
development run given ``--formats-from`` that file trains in them and reproduces that run's weeks (the eighth
development run in RESULTS.md did: weeks 1-5 of (c) equal to the fourth decimal).

One run's week 6 compares chains whose earlier weeks differ (a refused week moves everything after it), and a seed
moves a class's AP by 0.02 at this size. ``--same-state RUN_DIR`` (development) trains week 6 again from the champion
an earlier run's (c) entered it with, as (b) and as (c), once per ``--seeds``: the policy's own difference, and its
spread.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
from retrain.promotion.gate import decide  # noqa: E402
from retrain.promotion.promote import metrics_from_report  # noqa: E402
from retrain.training.train import train  # noqa: E402
from retrain.workspace import init_workspace, set_params  # noqa: E402

WEEKS = 6
#: Week -> (sample batch index: background, scale and classes; seed): a new class in week 3, other backgrounds in 5.
SAMPLE_WEEKS = {1: (1, 0), 2: (1, 1), 3: (2, 0), 4: (2, 1), 5: (3, 0), 6: (3, 1)}
POLICIES = {"a": ("scratch", {"use_champion": False, "warm": False, "replay": False}),
            "b": ("warm, full", {"use_champion": True, "warm": False, "replay": False}),
            "c": ("warm + replay", {"use_champion": True})}


def sample_weeks(base: Path, first: int, images: int) -> list[Path]:
    """The weekly sample batches: ``first`` images in week 1 (a team's first delivery), ``images`` a week after."""
    from retrain.data.sample import generate_batch

    return [generate_batch(base / "weeks" / f"week-{w}", idx, first if w == 1 else images, seed).path
            for w, (idx, seed) in SAMPLE_WEEKS.items()]


def _params(paths: Paths) -> Params:
    return load_params(paths.params)


def _train(paths: Paths, champion: RegisteredModel | None, policy: dict[str, Any], defaults: dict[str, Any]
           ) -> tuple[Path, float, dict[str, Any]]:
    set_params(paths, {f"train.{k}": v for k, v in {**defaults, **policy}.items()})
    params = _params(paths)
    t0 = time.perf_counter()
    result = train(paths, params, champion, runner.run_log(paths, params))
    seconds = time.perf_counter() - t0
    assert result is not None
    return result.candidate, seconds, result.report.model_dump(mode="json")


def _judge(paths: Paths, champion: RegisteredModel | None) -> dict[str, Any]:
    report = evaluate_models(paths, _params(paths), champion)
    champ, cand = metrics_from_report(report)
    decision = decide(champ, cand, _params(paths).promote)
    m = report.candidate.metrics
    return {"map": m.map, "per_class": dict(m.per_class), "per_batch": {k: v.map for k, v in m.slices.items()},
            "champion_map": report.champion.metrics.map if report.champion else None,
            "promoted": decision.promote, "reasons": list(decision.reasons)}


def run(batches: list[Path], base: Path, recipe: dict[str, Any], champion_epochs: int, only: str = "abc",
        warm: dict[str, Any] | None = None, formats: dict[str, bool] | None = None,
        replay: dict[str, Any] | None = None) -> dict[str, Any]:
    paths = init_workspace(base / "ws", remote=str(base / "remote"))
    fmt_file = paths.cache / "memory-format.json"  # train.channels_last: auto's choice per model, timed or given
    if formats:
        fmt_file.parent.mkdir(parents=True, exist_ok=True)
        fmt_file.write_text(json.dumps(formats, indent=1))
    set_params(paths, {"runtime.workers": 0, "runtime.cache": "ram", "evaluate.bootstrap": 50,
                       "validate.instances_level": "warn", "validate.val_fraction_level": "warn",
                       "validate.drift_level": "warn"})
    tp = _params(paths).train  # (c) as params.yaml has them
    defaults: dict[str, Any] = {k: v.model_dump() if v else v for k, v in (("warm", tp.warm), ("replay", tp.replay))}
    if warm and defaults["warm"]:
        defaults["warm"] = {**defaults["warm"], **warm}
    if replay and defaults["replay"]:
        defaults["replay"] = {**defaults["replay"], **replay}
    champions: dict[str, RegisteredModel | None] = {}
    weeks: list[dict[str, Any]] = []
    models = base / "models"
    models.mkdir()
    for week, batch in enumerate(batches, start=1):
        runner.run_ingest(paths, _params(paths), batch, None, "auto")
        runner.run_merge(paths, _params(paths))
        list(runner.run_validate(paths, _params(paths)))
        row: dict[str, Any] = {"week": week, "policies": {}}
        if week == 1:  # a champion that knows its data: the schedule's epochs x champion_epochs
            first_recipe = {**recipe, "epochs": recipe["epochs"] * champion_epochs,
                            "patience": recipe["epochs"] * champion_epochs}
            cand, seconds, report = _train(paths, None, {"use_champion": False}, {**first_recipe, **defaults})
            kept = models / "week-1.pt"
            shutil.copy2(cand, kept)
            first = RegisteredModel("bench", "1", kept)
            champions = {k: first for k in POLICIES}
            judged = _judge(paths, None)
            row["first"] = {"seconds": seconds, **judged}
            print(f"week 1: champion from scratch in {seconds:.0f} s, test mAP50-95 {judged['map']:.4f}", flush=True)
        else:
            for key, (name, policy) in POLICIES.items():
                if key not in only:
                    continue
                cand, seconds, report = _train(paths, champions[key], policy, {**recipe, **defaults})
                kept = models / f"week-{week}-{key}.pt"
                shutil.copy2(cand, kept)
                judged = _judge(paths, champions[key])
                if judged["promoted"]:
                    champions[key] = RegisteredModel("bench", f"{week}{key}", kept)
                row["policies"][key] = {"seconds": seconds, "epochs": report["epochs"],
                                        "replay": report.get("replay"), "class_runs": report.get("class_runs"),
                                        **judged}
                print(f"week {week} ({name}): {seconds:.0f} s, {report['epochs']} epochs, test mAP50-95 "
                      f"{judged['map']:.4f} (champion {judged['champion_map']:.4f}), "
                      f"{'promoted' if judged['promoted'] else 'not promoted'}", flush=True)
        weeks.append(row)
    master = json.loads((paths.master / "annotations.json").read_text())
    splits = {s: sum(im.get("split") == s for im in master["images"]) for s in ("train", "val", "test")}
    chosen = json.loads(fmt_file.read_text()) if fmt_file.is_file() else {}  # none timed: CUDA, or set by hand
    return {"weeks": weeks, "splits": splits, "defaults": defaults, "formats": chosen}


def same_state(run_dir: Path, seeds: list[int], warm: dict[str, Any], replay: dict[str, Any]) -> dict[str, Any]:
    """Development: week 6 again from the champion an earlier run's (c) entered it with, once per seed, as (b) (the
    full schedule on every image) and as (c) (that run's ``train.warm`` and ``train.replay``, with the options'
    overrides). Both start from the same model on the same master, so their difference is the policy's, and the
    seeds give its spread (a single run's week 6 compares two chains, whose earlier weeks differ)."""
    missing = [str(run_dir / n) for n in ("result.json", "ws", "models") if not (run_dir / n).exists()]
    if missing:
        sys.exit(f"{run_dir}: not a retrain_cost run's temp dir (missing: {', '.join(missing)})")
    try:
        earlier = json.loads((run_dir / "result.json").read_text())
    except ValueError as exc:
        sys.exit(f"{run_dir / 'result.json'}: not JSON ({exc})")
    if not isinstance(earlier, dict) or not {"weeks", "defaults"} <= earlier.keys():
        sys.exit(f"{run_dir / 'result.json'}: records no 'weeks' and 'defaults': not a retrain_cost run's result")
    if not any("c" in row["policies"] for row in earlier["weeks"][1:]) or not earlier["defaults"]["warm"]:
        sys.exit(f"{run_dir}: that run trained no (c) with train.warm on; --same-state needs one")
    last = 1
    for row in earlier["weeks"][1:-1]:
        if row["policies"].get("c", {}).get("promoted"):
            last = row["week"]
    weights = run_dir / "models" / ("week-1.pt" if last == 1 else f"week-{last}-c.pt")
    if not weights.is_file():
        sys.exit(f"{weights}: missing; it is the champion (c) entered week 6 with, and --same-state starts from it")
    champion = RegisteredModel("bench", f"{last}c", weights)
    ws = Path(tempfile.mkdtemp(prefix="retrain-cost-same-")) / "ws"
    shutil.copytree(run_dir / "ws", ws, symlinks=True)  # the master as week 6 trained on it
    paths = Paths(ws)
    d = earlier["defaults"]
    c_policy = {"use_champion": True, "warm": {**d["warm"], **warm},
                "replay": {**d["replay"], **replay} if d["replay"] else False}
    rows: list[dict[str, Any]] = []
    for seed in seeds:
        for key, policy in (("b", POLICIES["b"][1]), ("c", c_policy)):
            shutil.rmtree(paths.checkpoints, ignore_errors=True)  # a fresh run, not a resumed one
            _, seconds, report = _train(paths, champion, {**policy, "seed": seed}, {})
            judged = _judge(paths, champion)
            rows.append({"seed": seed, "policy": key, "seconds": seconds, "epochs": report["epochs"],
                         "replay": report.get("replay"), **judged})
            print(f"seed {seed} ({key}): {seconds:.0f} s, {report['epochs']} epochs, test mAP50-95 {judged['map']:.4f} "
                  + ", ".join(f"{k} {v:.3f}" for k, v in judged["per_class"].items()), flush=True)
    b = {r["seed"]: r for r in rows if r["policy"] == "b"}
    c = {r["seed"]: r for r in rows if r["policy"] == "c"}
    old = sorted(earlier["weeks"][0]["first"]["per_class"])
    gaps = [c[s]["map"] - b[s]["map"] for s in seeds]
    worst = [min(c[s]["per_class"][k] - b[s]["per_class"][k] for k in old) for s in seeds]
    per_class = {k: statistics.mean(c[s]["per_class"][k] - b[s]["per_class"][k] for s in seeds)
                 for k in c[seeds[0]]["per_class"]}
    summary = {"champion": weights.name, "c": c_policy, "seeds": seeds,
               "time_c_over_b": statistics.mean(c[s]["seconds"] / b[s]["seconds"] for s in seeds),
               "map_b": statistics.mean(b[s]["map"] for s in seeds),
               "map_c": statistics.mean(c[s]["map"] for s in seeds),
               "gap_mean": statistics.mean(gaps), "gap_sd": statistics.pstdev(gaps), "gaps": gaps,
               "worst_old_class": worst, "per_class_gap_mean": per_class}
    shutil.rmtree(ws.parent, ignore_errors=True)
    return {"rows": rows, "summary": summary}


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    weeks = [r["week"] for r in result["weeks"][1:]]
    fig, (t_ax, m_ax) = plt.subplots(1, 2, figsize=(10, 3.6))
    for key, (name, _) in POLICIES.items():
        rows = [r["policies"][key] for r in result["weeks"][1:]]
        t_ax.plot(weeks, [r["seconds"] for r in rows], marker="o", label=f"({key}) {name}")
        m_ax.plot(weeks, [r["map"] for r in rows], marker="o", label=f"({key}) {name}")
        promoted = [(w, r["map"]) for w, r in zip(weeks, rows, strict=True) if r["promoted"]]
        if promoted:
            m_ax.scatter(*zip(*promoted, strict=True), marker="*", s=120, zorder=3, color="black")
    t_ax.set(xlabel="week", ylabel="training wall time (s)", title="cost per week")
    m_ax.set(xlabel="week", ylabel="test mAP50-95", title="candidate quality (* = promoted)")
    t_ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def section(result: dict[str, Any], args: argparse.Namespace, wall: float, png: str) -> str:
    last = result["weeks"][-1]["policies"]
    a, b, c = (last[k] for k in "abc")
    first_classes = set(result["weeks"][0]["first"]["per_class"])
    old = sorted(first_classes)
    worst_old = min(c["per_class"][k] - b["per_class"][k] for k in old)
    better = max(a["map"], b["map"])
    d = result["defaults"]
    lines = [
        f"## retrain_cost: a weekly retrain over six batches, three policies ({args.data})", "",
        f"Machine: {machine()}. Run: `python bench/retrain_cost.py --data {args.data} --first {args.first} "
        f"--images {args.images} --champion-epochs {args.champion_epochs} "
        f"--epochs {args.epochs} --imgsz {args.imgsz} --batch {args.batch}` ({wall / 60:.0f} min; master at week 6: "
        f"{result['splits']['train']}/{result['splits']['val']}/{result['splits']['test']} train/val/test images). "
        f"Recipe: yolo11n, {args.epochs} epochs at imgsz {args.imgsz}, batch {args.batch} (week 1's champion: "
        f"{args.epochs * args.champion_epochs} epochs); (c) with `train.warm` "
        f"{json.dumps(d['warm'])} and `train.replay` {json.dumps(d['replay'])}. (a) from scratch on the whole master, "
        "(b) warm start from its champion with the full schedule on every image every epoch, (c) warm start with "
        "`train.warm` and `train.replay`; each from the same week-1 champion, each judged by the gate against its own "
        "champion on the same test images. Time: the whole train stage in-process.", "",
        f"Week 6: (c) took **{c['seconds'] / a['seconds']:.2f}x** the time of (a) (target <= 0.35) and "
        f"**{c['seconds'] / b['seconds']:.2f}x** of (b) (target <= 0.5); its test mAP50-95 is "
        f"**{c['map'] - better:+.4f}** from the better of (a) and (b) (target >= -0.01); its worst week-1 class is "
        f"**{worst_old:+.4f}** from (b)'s (target >= -0.02).", "",
        f"![time and mAP per week]({png})", "",
        "| week | policy | train s | epochs | images/epoch (new + old) | test mAP50-95 | champion's | promoted | "
        "AP50-95 per class | mAP50-95 per origin batch |",
        "|---:|---|---:|---:|---|---:|---:|---|---|---|",
    ]
    w1 = result["weeks"][0]["first"]
    lines.append(f"| 1 | first champion, from scratch | {w1['seconds']:.0f} | | | {w1['map']:.4f} | | yes | "
                 + ", ".join(f"{k} {v:.3f}" for k, v in w1["per_class"].items()) + " | |")
    for row in result["weeks"][1:]:
        for key, (name, _) in POLICIES.items():
            r = row["policies"][key]
            rp = r["replay"]
            per_epoch = f"{rp['new_images']} + {rp['old_per_epoch']} of {rp['old_images']}" if rp else "all"
            limit = d["warm"]["new_class_runs"] if d["warm"] else 0
            young = {k: n for k, n in (r.get("class_runs") or {}).items() if n <= limit}
            if key == "c" and young:  # why a warm run trained the full schedule on every image
                per_epoch += " (young: " + ", ".join(f"{k} run {n}" for k, n in young.items()) + ")"
            lines.append(
                f"| {row['week']} | ({key}) {name} | {r['seconds']:.0f} | {r['epochs']} | {per_epoch} | "
                f"{r['map']:.4f} | {r['champion_map']:.4f} | {'yes' if r['promoted'] else 'no'} | "
                + ", ".join(f"{k} {v:.3f}" for k, v in r["per_class"].items()) + " | "
                + ", ".join(f"{k} {v:.3f}" for k, v in r["per_batch"].items()) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", choices=("sample", "coco128"), default="sample")
    ap.add_argument("--first", type=int, default=60, help="images of the first sample batch (week 1)")
    ap.add_argument("--images", type=int, default=24, help="images per weekly sample batch after it")
    ap.add_argument("--epochs", type=int, default=40, help="train.epochs: the from-scratch schedule")
    ap.add_argument("--champion-epochs", type=int, default=3,
                    help="week 1's champion trains this many times --epochs (a champion that knows its data)")
    ap.add_argument("--imgsz", type=int, default=160)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--policies", default="abc", help="development: a subset (e.g. c) is printed, not written")
    ap.add_argument("--warm-epochs", type=int, help="development: train.warm.epochs for (c) instead of params'")
    ap.add_argument("--new-class-runs", type=int, help="development: train.warm.new_class_runs for (c)")
    ap.add_argument("--formats-from", type=Path, help="development: train in the memory formats an earlier run's "
                    "result.json recorded (its 'formats'), so that its weeks are reproduced, not re-timed")
    ap.add_argument("--from-json", type=Path, help="write the section and plot from an earlier run's result.json")
    ap.add_argument("--same-state", type=Path, metavar="RUN_DIR",
                    help="development: week 6 again, as (b) and as (c), from the champion that an earlier run's (c) "
                    "entered it with (RUN_DIR: that run's temp dir: result.json, ws/, models/), once per --seeds")
    ap.add_argument("--seeds", default="0,1,2,3", help="with --same-state: the training seeds")
    ap.add_argument("--old-fraction", type=float, help="development: train.replay.old_fraction for (c)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    warm = {k: v for k, v in (("epochs", args.warm_epochs), ("new_class_runs", args.new_class_runs)) if v is not None}
    replay = {} if args.old_fraction is None else {"old_fraction": args.old_fraction}
    if args.same_state:
        try:
            seeds = [int(s) for s in args.seeds.split(",")]
        except ValueError:
            sys.exit(f"--seeds {args.seeds!r}: give integers separated by commas, e.g. 0,1,2,3")
        same = same_state(args.same_state, seeds, warm, replay)
        print(json.dumps(same["summary"], indent=1))
        return
    if args.from_json:  # the section and plot again from a run's raw results
        result = json.loads(args.from_json.read_text())
    else:
        formats = json.loads(args.formats_from.read_text()).get("formats") if args.formats_from else None
        if args.formats_from and not formats:
            sys.exit(f"{args.formats_from}: records no memory formats ('formats'): a run before the bench kept them, "
                     "or one that timed none")
        base = Path(tempfile.mkdtemp(prefix="retrain-cost-"))
        batches = sample_weeks(base, args.first, args.images) if args.data == "sample" else coco128_batches(base, WEEKS)
        recipe = {"imgsz": args.imgsz, "epochs": args.epochs, "batch": args.batch, "base_model": "", "seed": 0,
                  "patience": args.epochs}
        result = run(batches, base, recipe, args.champion_epochs, args.policies, warm, formats, replay)
        result["wall"] = time.perf_counter() - t0
        (base / "result.json").write_text(json.dumps(result, indent=1))
        print(f"raw results: {base / 'result.json'}")
    development = args.policies != "abc" or any(
        v is not None for v in (args.warm_epochs, args.new_class_runs, args.formats_from, args.old_fraction))
    if development:  # its figures on the terminal, RESULTS.md untouched
        print(json.dumps(result["weeks"][-1], indent=1))
        return
    png = f"retrain_cost_{args.data}.png"
    plot(result, HERE / png)
    text = section(result, args, result["wall"], png)
    update_results_md(text)
    print(text)


if __name__ == "__main__":
    main()
