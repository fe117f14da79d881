"""``reports/promotion.json``: what ``retrain promote`` registered and decided, as the flow reads it."""

from __future__ import annotations

from typing import ClassVar

from retrain.reports import Report


class PromotionReport(Report):
    """A registered candidate and the gate's decision.

    Attributes:
        model: The registered model's name.
        version: The new (or reused) model version.
        promoted: Whether ``champion`` moved to it.
        reasons: Every rule of the gate that failed, in plain words (empty when promoted).
        notes: What the gate reported but did not judge (classes with too few val boxes...).
        parent_version: The champion before this promotion (``None``: there was none).
        champion: The champion after it.
        tags: The version's lineage tags.
        tracking_uri: The registry (without a password).
    """

    what: ClassVar[str] = "promotion report"

    model: str
    version: str
    promoted: bool
    reasons: list[str]
    notes: list[str]
    parent_version: str | None
    champion: str | None
    tags: dict[str, str]
    tracking_uri: str
