"""Replay sampling: what one epoch of a warm-started run trains on.

A champion already knows the data it trained on.  Each epoch of a run warm-started from it covers every train image
of the batches newer than that data, and a sample of the older train images: ``old_fraction`` of them, drawn
class-aware first so that every class of the older images keeps ``min_per_class`` boxes an epoch (all of its boxes
when it has fewer), then at random.  The draw depends on (seed, epoch) alone, so a resumed run draws what an unbroken
one does; the epoch's length is the same every epoch (the largest class-aware draw of the run decides it), so
Lightning's step count and the LR schedule hold.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from retrain.config import ReplayParams


@dataclass(frozen=True)
class ReplayPlan:
    """The train split of a warm-started run, as replay sampling sees it.

    Attributes:
        new: Indices (into the train dataset) of the images of the batches newer than the champion's data.
        old: Indices of the older images.
        boxes: Per older index, its boxes per class index.
        old_per_epoch: Older images drawn each epoch.
        min_per_class: Boxes each class of the older images keeps every epoch.
        new_batches: The batches counted as new.
        holding: Per class of the older images, the older images that hold it (built once, with ``boxes``).
        total: Per class of the older images, its boxes in all of them.
    """

    new: list[int]
    old: list[int]
    boxes: dict[int, Counter[int]]
    old_per_epoch: int
    min_per_class: int
    new_batches: list[str] = field(default_factory=list)
    holding: dict[int, list[int]] = field(default_factory=dict)
    total: Counter[int] = field(default_factory=Counter)

    @property
    def size(self) -> int:
        """Images an epoch trains on."""
        return len(self.new) + self.old_per_epoch

    def draw(self, seed: int, epoch: int) -> list[int]:
        """The epoch's images (in no particular order): every new one, then the older ones drawn for it."""
        chosen = _class_aware(self.boxes, self.holding, self.total, self.min_per_class,
                              random.Random(f"{seed}:{epoch}:replay"))
        taken = set(chosen)
        rest = [i for i in self.old if i not in taken]
        random.Random(f"{seed}:{epoch}:fill").shuffle(rest)
        return self.new + chosen + rest[: self.old_per_epoch - len(chosen)]

    def describe(self) -> str:
        """One line for the log."""
        return (f"replay: each epoch trains on the {len(self.new)} train images of the batches newer than the "
                f"champion ({', '.join(self.new_batches) or 'none'}) and {self.old_per_epoch} of the "
                f"{len(self.old)} older ones (at least {self.min_per_class} boxes of each older class)")


def _by_class(old: list[int], boxes: dict[int, Counter[int]]) -> tuple[dict[int, list[int]], Counter[int]]:
    """Per class, the older images holding it and its boxes in all of them."""
    total: Counter[int] = Counter()
    holding: dict[int, list[int]] = {}
    for i in old:
        total.update(boxes[i])
        for c in boxes[i]:
            holding.setdefault(c, []).append(i)
    return holding, total


def _class_aware(boxes: dict[int, Counter[int]], holding: dict[int, list[int]], total: Counter[int], per_class: int,
                 rng: random.Random) -> list[int]:
    """Older images drawn until each class has ``per_class`` boxes (or all it has), rarest class first."""
    chosen: list[int] = []
    taken: set[int] = set()
    have: Counter[int] = Counter()
    for c in sorted(total, key=lambda k: (total[k], k)):
        need = min(per_class, total[c])
        if have[c] >= need:
            continue
        candidates = [i for i in holding[c] if i not in taken]
        rng.shuffle(candidates)
        for i in candidates:
            chosen.append(i)
            taken.add(i)
            have.update(boxes[i])
            if have[c] >= need:
                break
    return chosen


def plan(batches: list[str], labels: list[dict[str, Any]], known: list[str], params: ReplayParams, seed: int,
         epochs: int) -> ReplayPlan:
    """The replay plan of a train split.

    Args:
        batches: Each train image's batch of origin (in dataset order).
        labels: Each train image's ultralytics label dict (``cls``: class indices).
        known: The batches the champion trained on.
        params: ``train.replay``.
        seed: ``train.seed``.
        epochs: Epochs of the run (the epoch length is the largest class-aware draw among them).

    Returns:
        The plan.
    """
    seen = set(known)
    new = [i for i, b in enumerate(batches) if b not in seen]
    old = [i for i, b in enumerate(batches) if b in seen]
    boxes = {i: Counter(int(c) for c in labels[i]["cls"].reshape(-1)) for i in old}
    holding, total = _by_class(old, boxes)
    want = min(len(old), math.ceil(params.old_fraction * len(old)))
    most = max((len(_class_aware(boxes, holding, total, params.min_per_class, random.Random(f"{seed}:{e}:replay")))
                for e in range(epochs)), default=0)
    return ReplayPlan(new, old, boxes, max(want, most), params.min_per_class,
                      sorted({b for b in batches if b not in seen}), holding, total)
