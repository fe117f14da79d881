"""Replay sampling (``data.replay``): what each epoch of a warm-started run draws, and the sampler around it."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np

from retrain.config import ReplayParams
from retrain.data.loading import EpochSampler
from retrain.data.replay import plan


def _split(seed: int = 3) -> tuple[list[str], list[dict[str, np.ndarray]]]:
    """100 older images (batch-1, batch-2) with a rare class 3 in five of them, and 20 new ones (batch-3)."""
    rng = random.Random(seed)
    batches, labels = [], []
    for i in range(120):
        batch = "batch-1" if i < 50 else "batch-2" if i < 100 else "batch-3"
        classes = [rng.randrange(3) for _ in range(rng.randint(1, 4))]
        if i in (7, 33, 61, 80, 95):
            classes.append(3)  # rare: six boxes in all (one image holds two)
        if i == 61:
            classes.append(3)
        if batch == "batch-3":
            classes.append(4)  # a class the champion never saw
        batches.append(batch)
        labels.append({"cls": np.array(classes, dtype=np.float32).reshape(-1, 1)})
    return batches, labels


def _boxes(labels: list[dict[str, np.ndarray]], items: list[int]) -> Counter[int]:
    out: Counter[int] = Counter()
    for i in items:
        out.update(int(c) for c in labels[i]["cls"].reshape(-1))
    return out


def test_every_epoch_draws_every_new_image_and_min_per_class_boxes_of_each_older_class():
    batches, labels = _split()
    p = plan(batches, labels, ["batch-1", "batch-2"], ReplayParams(old_fraction=0.1, min_per_class=25), seed=0,
             epochs=8)
    new = set(range(100, 120))
    assert set(p.new) == new and p.new_batches == ["batch-3"] and len(p.old) == 100
    older = _boxes(labels, list(range(100)))
    draws = [p.draw(0, e) for e in range(8)]
    for items in draws:
        assert len(items) == len(set(items)) == p.size  # no image twice, one length every epoch
        assert new <= set(items)
        got = _boxes(labels, [i for i in items if i not in new])
        for c in older:
            assert got[c] >= min(25, older[c]), (c, got[c], older[c])
        assert got[3] == 6  # the rare class: all of its boxes, every epoch
    assert p.old_per_epoch >= 10  # old_fraction's share at least
    assert len({tuple(sorted(d)) for d in draws}) > 1  # the older sample differs between epochs
    again = plan(batches, labels, ["batch-1", "batch-2"], ReplayParams(old_fraction=0.1, min_per_class=25), seed=0,
                 epochs=8)
    assert [again.draw(0, e) for e in range(8)] == draws  # (seed, epoch) alone decide: a resumed run draws the same
    other = plan(batches, labels, ["batch-1", "batch-2"], ReplayParams(old_fraction=0.1, min_per_class=25), seed=1,
                 epochs=8)
    assert [other.draw(1, e) for e in range(8)] != draws


def test_old_fraction_sets_the_sample_when_classes_need_fewer():
    batches, labels = _split()
    p = plan(batches, labels, ["batch-1", "batch-2"], ReplayParams(old_fraction=0.5, min_per_class=1), seed=0,
             epochs=3)
    assert p.old_per_epoch == 50 and p.size == 70
    full = plan(batches, labels, ["batch-1", "batch-2"], ReplayParams(old_fraction=1.0, min_per_class=0), seed=0,
                epochs=3)
    assert sorted(full.draw(0, 2)) == list(range(120))


def test_a_champion_that_knew_every_batch_replays_old_images_only_and_one_that_knew_none_trains_all_as_new():
    batches, labels = _split()
    known_all = plan(batches, labels, ["batch-1", "batch-2", "batch-3"], ReplayParams(old_fraction=0.25), seed=0,
                     epochs=2)
    assert known_all.new == [] and known_all.size == known_all.old_per_epoch == 30
    none = plan(batches, labels, [], ReplayParams(), seed=0, epochs=2)
    assert none.new == list(range(120)) and none.old == [] and none.size == 120


def test_the_sampler_shuffles_the_epochs_draw_and_ranks_share_it():
    batches, labels = _split()
    p = plan(batches, labels, ["batch-1", "batch-2"], ReplayParams(old_fraction=0.2, min_per_class=10), seed=0,
             epochs=4)
    one = EpochSampler(120, seed=0, shuffle=True, replay=p)
    one.set_epoch(2)
    keys = list(one)
    assert len(one) == len(keys) == p.size and all(e == 2 and r == 0 for _, e, r in keys)
    assert sorted(i for i, _, _ in keys) == sorted(p.draw(0, 2))
    assert [i for i, _, _ in keys] != p.draw(0, 2)  # shuffled
    ranks = [EpochSampler(120, seed=0, shuffle=True, rank=r, world=2, replay=p) for r in (0, 1)]
    for s in ranks:
        s.set_epoch(2)
    shards = [[i for i, _, _ in s] for s in ranks]
    assert set(shards[0]) | set(shards[1]) == set(p.draw(0, 2)) and len(shards[0]) == len(shards[1])
    plain = EpochSampler(120, seed=0, shuffle=True)
    plain.set_epoch(2)
    assert sorted(i for i, _, _ in plain) == list(range(120))  # no plan: every image


def test_the_warm_schedule_applies_to_a_champion_warm_start_that_brings_no_new_class():
    from retrain.config import TrainParams, WarmParams
    from retrain.detector.files import ModelFile
    from retrain.training.train import schedule

    p = TrainParams(epochs=30, lr=0.002, warm=WarmParams(epochs=12, lr=0.001, warmup_epochs=0.5, close_mosaic=3))
    champion = {"kind": "champion", "model": "m", "version": "3"}
    known = ModelFile({}, {}, ("circle", "square"), 320, {})
    warm = schedule(p, champion, known, ("circle", "square"))
    assert (warm.epochs, warm.lr, warm.warmup_epochs, warm.augment.close_mosaic) == (12, 0.001, 0.5, 3)
    assert schedule(p.model_copy(update={"epochs": 5}), champion, known, ("circle",)).epochs == 5  # never more
    assert schedule(p, champion, known, ("circle", "square", "star")) is p  # a new class: the full schedule
    assert schedule(p, {"kind": "file", "path": "x.pt"}, known, ("circle",)) is p  # base_model: the full schedule
    assert schedule(p, {"kind": "scratch"}) is p
    off = p.model_copy(update={"warm": False})
    assert schedule(off, champion, known, ("circle",)) is off  # warm: off


def test_a_new_class_keeps_the_full_schedule_for_its_first_new_class_runs_runs_then_the_warm_one_applies():
    from retrain.config import TrainParams, WarmParams
    from retrain.detector.files import ModelFile
    from retrain.training.train import next_class_runs, schedule

    p = TrainParams(epochs=30, warm=WarmParams(epochs=12, new_class_runs=3))
    champion = {"kind": "champion", "model": "m", "version": "3"}
    names = ("circle", "square", "star")
    base = ModelFile({}, {}, ("circle", "square"), 320, {})  # from scratch, or an earlier retrain: no record
    epochs = []
    for _ in range(5):  # each run's model is the next run's champion
        epochs.append(schedule(p, champion, base, names).epochs)
        base = ModelFile({}, {}, names, 320, {"class_runs": next_class_runs(base, names)})
    assert epochs == [30, 30, 30, 12, 12]  # star arrives: its run and the next two take train.epochs
    assert base.meta["class_runs"] == {"star": 5}  # counted on; the established classes never are
    one = p.model_copy(update={"warm": WarmParams(epochs=12, new_class_runs=1)})
    assert schedule(one, champion, ModelFile({}, {}, names, 320, {"class_runs": {"star": 1}}), names).epochs == 12
    assert next_class_runs(None, names) == {}  # from scratch: every class established
    odd = ModelFile({}, {}, names, 320, {"class_runs": ["star"]})  # a record it cannot read counts nothing
    assert schedule(p, champion, odd, names).epochs == 12 and next_class_runs(odd, names) == {}


def test_replay_applies_to_warm_runs_and_not_while_a_class_is_young():
    from retrain.config import TrainParams, WarmParams
    from retrain.detector.files import ModelFile
    from retrain.training.train import known_batches

    p = TrainParams(epochs=30, warm=WarmParams(epochs=12, new_class_runs=2))
    champion = {"kind": "champion", "model": "m", "version": "3"}
    names = ("circle", "star")
    settled = ModelFile({}, {}, names, 320, {"batches": ["b1", "b2"], "class_runs": {"star": 2}})
    assert known_batches(p, settled, champion, names) == ["b1", "b2"]  # star's 3rd run: replay
    young = ModelFile({}, {}, names, 320, {"batches": ["b1", "b2"], "class_runs": {"star": 1}})
    assert known_batches(p, young, champion, names) is None  # star's 2nd run: every image, as the schedule is full
    old = ModelFile({}, {}, ("circle",), 320, {"batches": ["b1"]})
    assert known_batches(p, old, champion, names) is None  # star arrives
    assert known_batches(p, old, champion, ("circle",)) == ["b1"]
    never = p.model_copy(update={"warm": WarmParams(epochs=12, new_class_runs=0)})
    assert known_batches(never, old, champion, names) == ["b1"]  # 0: a new class takes the warm run and replay
    assert known_batches(p.model_copy(update={"replay": False}), settled, champion, names) is None  # replay: off
    assert known_batches(p, settled, {"kind": "file", "path": "x.pt"}, names) is None  # base_model: everything


def test_the_flows_progress_bar_reads_the_warm_epochs_from_the_train_stages_log_line(tmp_path, caplog):
    import logging

    from retrain.config import TrainParams, WarmParams
    from retrain.detector.files import ModelFile
    from retrain.training.train import schedule
    from tasks.artifacts import TrainingProgress

    p = TrainParams(epochs=30, warm=WarmParams(epochs=7))
    with caplog.at_level(logging.INFO, logger="retrain"):
        schedule(p, {"kind": "champion", "model": "m", "version": "3"}, ModelFile({}, {}, ("a",), 320, {}), ("a",))
    progress = TrainingProgress(tmp_path, p.epochs)
    for record in caplog.records:
        progress.read_plan(f"{record.levelname} {record.getMessage()}")
    assert progress.epochs == 7
