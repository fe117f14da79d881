"""The label audit's adapter to cleanlab (real cleanlab, no model): it flags what cleanlab flags, and names the kind."""

from __future__ import annotations

import random

import numpy as np
import pytest
from cleanlab.object_detection.filter import find_label_issues
from cleanlab.object_detection.rank import get_label_quality_scores

from retrain.audit.issues import cleanlab_inputs, find_issues

NAMES = ("circle", "square", "triangle")


def _data(seed: int = 0, n: int = 60) -> tuple[list, list, dict[int, str]]:
    """Images of 3 well-separated boxes, a confident detector that finds them all, and one planted error in every
    third image: a label removed (missing), relabelled (wrong_class) or shifted by half its size (bad_location)."""
    rng = random.Random(seed)
    labels, preds, planted = [], [], {}
    for i in range(n):
        boxes = [(k, [40.0 + 110 * k + rng.uniform(-5, 5), 40 + rng.uniform(-5, 5), 60.0, 50.0]) for k in range(3)]
        preds.append([(k, [b[0] + rng.uniform(-1, 1), b[1] + rng.uniform(-1, 1), b[2], b[3]], rng.uniform(0.96, 0.99))
                      for k, b in boxes] + [((k + 1) % 3, b, 0.02) for k, b in boxes])
        if i % 3 == 0:
            kind = ("missing", "wrong_class", "bad_location")[(i // 3) % 3]
            planted[i] = kind
            if kind == "missing":
                boxes = boxes[1:]
            elif kind == "wrong_class":
                boxes[1] = ((boxes[1][0] + 1) % 3, boxes[1][1])
            else:
                b = boxes[2][1]
                boxes[2] = (boxes[2][0], [b[0] + b[2] / 2, b[1] + b[3] / 2, b[2], b[3]])
        labels.append(boxes)
    return labels, preds, planted


def test_it_flags_exactly_what_cleanlab_flags_and_scores_as_cleanlab_does_at_cleanlabs_level():
    labels, preds, _ = _data()
    cl_labels, cl_preds = cleanlab_inputs(labels, preds, len(NAMES))
    audits = find_issues(cl_labels, cl_preds, NAMES, confident=0.95)
    ours = np.array([a.flagged for a in audits])
    theirs = find_label_issues(cl_labels, cl_preds)
    assert ours.any() and (ours == theirs).all()
    assert np.allclose([a.score for a in audits], get_label_quality_scores(cl_labels, cl_preds, verbose=False),
                       atol=1e-6)


def test_each_planted_error_is_found_with_its_kind_and_clean_images_are_not_flagged():
    labels, preds, planted = _data()
    audits = find_issues(*cleanlab_inputs(labels, preds, len(NAMES)), NAMES, confident=0.5)
    flagged = {i for i, a in enumerate(audits) if a.flagged}
    assert flagged == set(planted), (sorted(flagged), sorted(planted))
    for i, kind in planted.items():
        assert kind in {x.kind for x in audits[i].issues}, (i, kind, audits[i].issues)
    swapped = next(x for i, k in planted.items() if k == "wrong_class" for x in audits[i].issues
                   if x.kind == "wrong_class")
    assert swapped.label == "triangle" and swapped.predicted == "square" and swapped.confidence > 0.9
    missing = next(x for i, k in planted.items() if k == "missing" for x in audits[i].issues)
    assert missing.kind == "missing" and missing.label is None and missing.predicted == "circle"
    # The worst images are the planted ones.
    worst = sorted(range(len(audits)), key=lambda i: audits[i].score)[:len(planted)]
    assert set(worst) == set(planted)


@pytest.mark.parametrize("confident", [0.5, 0.95])
def test_a_class_the_detector_never_predicts_is_never_an_issue(confident: float):
    """A new class: the champion has never seen it, so its AP here is 0 and cleanlab's threshold for it is 0."""
    labels, preds, _ = _data(n=9)
    preds = [[p for p in im if p[0] != 2] for im in preds]
    audits = find_issues(*cleanlab_inputs(labels, preds, len(NAMES)), NAMES, confident)
    assert not any(x.label == "triangle" for a in audits for x in a.issues)
    assert any(a.flagged for a in audits)  # the planted errors of the known classes still are
