"""The promotion gate: a pure function of two models' metrics and the gate params (no I/O).

``decide`` says whether the candidate replaces the champion, and gives every rule that failed as a
reason in plain words.  The metrics are those of the judged split (test: images no training choice
looked at).  Rules (all must hold): the mAP50-95 delta reaches ``min_delta``; no class with enough boxes
loses more than ``max_class_drop`` AP (the forgetting guard); no origin batch's images lose more than
``max_slice_drop``; when ``max_size_drop`` is set, no object size (small, medium, large), overall or
within a class with enough boxes of that size, loses more than it; optionally the bootstrap interval's
lower bound is above 0.  With no champion, the candidate needs ``min_map``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from retrain.config import PromoteParams


@dataclass(frozen=True)
class ModelMetrics:
    """What the gate reads of one model's evaluation.

    Attributes:
        map: mAP50-95 on all val images.
        per_class: Class name -> AP50-95 (-1: no ground truth).
        slices: Origin batch -> mAP50-95 on its val images (-1: no ground truth).
        instances: Class name -> boxes (the same for both models: the same images).
        delta_ci: For the candidate: the bootstrap interval ``(low, high)`` of candidate-minus-champion mAP50-95.
        sizes: Object size -> mAP50-95 (-1: no object of that size).
        per_class_size: Class name -> size -> AP50-95.
        size_instances: Class name -> size -> boxes.
    """

    map: float
    per_class: Mapping[str, float] = field(default_factory=dict)
    slices: Mapping[str, float] = field(default_factory=dict)
    instances: Mapping[str, int] = field(default_factory=dict)
    delta_ci: tuple[float, float] | None = None
    sizes: Mapping[str, float] = field(default_factory=dict)
    per_class_size: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    size_instances: Mapping[str, Mapping[str, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """The gate's verdict.

    Attributes:
        promote: Whether ``champion`` moves to the candidate.
        reasons: Every failed rule in plain words (empty when promoted).
        notes: What was reported but not gated (classes with too few val boxes).
    """

    promote: bool
    reasons: tuple[str, ...]
    notes: tuple[str, ...] = ()


def decide(champion: ModelMetrics | None, candidate: ModelMetrics, gate: PromoteParams) -> Decision:
    """Whether the candidate should become the champion.

    Args:
        champion: The champion's metrics on the judged images; ``None`` when there is no champion yet.
        candidate: The candidate's metrics on the same images (with ``delta_ci`` when there is a champion).
        gate: The ``promote`` params.

    Returns:
        The decision with its reasons.
    """
    if champion is None:
        if candidate.map >= gate.min_map:
            return Decision(True, ())
        return Decision(False, (f"first model: mAP50-95 {candidate.map:.4f} is below min_map {gate.min_map:.4f}",))
    reasons: list[str] = []
    notes: list[str] = []
    delta = candidate.map - champion.map
    if delta < gate.min_delta:
        reasons.append(f"mAP50-95 {candidate.map:.4f} vs champion {champion.map:.4f}: delta {delta:+.4f} is below "
                       f"min_delta {gate.min_delta:+.4f}")
    _guard([(f"forgetting: class {name}", f"class {name}", "AP50-95", old, candidate.per_class.get(name, 0.0),
             candidate.instances.get(name, 0)) for name, old in sorted(champion.per_class.items())],
           "max_class_drop", gate.max_class_drop, gate.min_class_instances, reasons, notes)
    for name, old in sorted(champion.slices.items()):
        new = candidate.slices.get(name, -1.0)
        if old >= 0 and new >= 0 and old - new > gate.max_slice_drop:
            reasons.append(f"slice {name}: mAP50-95 fell {old:.4f} -> {new:.4f} ({new - old:+.4f}; "
                           f"max_slice_drop {gate.max_slice_drop:.4f})")
    if gate.max_size_drop is not None:
        _size_rules(champion, candidate, gate, gate.max_size_drop, reasons, notes)
    if gate.require_significant:
        if candidate.delta_ci is None:
            reasons.append("require_significant: no bootstrap interval for the delta")
        elif candidate.delta_ci[0] <= 0:
            low, high = candidate.delta_ci
            reasons.append(f"not significant: the delta's interval [{low:+.4f}, {high:+.4f}] does not lie above 0")
    return Decision(not reasons, tuple(reasons), tuple(notes))


def _size_rules(champion: ModelMetrics, candidate: ModelMetrics, gate: PromoteParams, limit: float,
                reasons: list[str], notes: list[str]) -> None:
    """``max_size_drop``: each object size overall, then within each class, like the forgetting guard."""
    checks = [(f"size {size}:", f"{size} objects", "mAP50-95", old, candidate.sizes.get(size, -1.0),
               sum(c.get(size, 0) for c in candidate.size_instances.values()))
              for size, old in champion.sizes.items()]
    checks += [(f"size: class {name}, {size} objects:", f"class {name}, {size} objects", "AP50-95", old,
                candidate.per_class_size.get(name, {}).get(size, -1.0),
                candidate.size_instances.get(name, {}).get(size, 0))
               for name, sizes in sorted(champion.per_class_size.items()) for size, old in sizes.items()]
    _guard(checks, "max_size_drop", limit, gate.min_class_instances, reasons, notes)


def _guard(checks: list[tuple[str, str, str, float, float, int]], limit_name: str, limit: float, min_instances: int,
           reasons: list[str], notes: list[str]) -> None:
    """The forgetting guard's rule, for classes and object sizes: a fall of more than ``limit`` refuses the candidate
    where the judged images hold ``min_instances`` boxes or more, and is only reported where they hold fewer.

    Each check is (reason prefix, note prefix, metric, champion's value, candidate's value, boxes); a negative value
    means no ground truth there (not judged).
    """
    for reason, note, metric, old, new, boxes in checks:
        if old < 0 or new < 0 or old - new <= limit:
            continue
        if boxes < min_instances:
            notes.append(f"{note}: {metric} {old:.4f} -> {new:.4f} not gated: {boxes} boxes (min_class_instances "
                         f"{min_instances})")
        else:
            reasons.append(f"{reason} {metric} fell {old:.4f} -> {new:.4f} ({new - old:+.4f}; {limit_name} "
                           f"{limit:.4f})")
