"""Groups of near-copies: images that must share one split.

Consecutive video frames, bursts and re-encoded copies are nearly the same picture.  If they land in different
splits, val and test measure memory, not generalisation.  Two images belong to one group when their perceptual
hashes (``imagehash.phash`` with a 16x16 DCT: 256 bits, of the decoded image) differ in at most ``distance``
bits, or when the labels say they are frames of one sequence (``sequence`` in the canonical batch, scoped to its
batch); groups are the connected components of that relation.

A group's split is its *anchor's*: the member that arrived first (ingest order), so a new near-copy of an existing
image joins that image's split.  Only a new image that links two groups whose anchors had different splits moves
anything (the later group joins the earlier); :func:`group_images` reports each such move.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import imagehash
import numpy as np
from PIL import Image, ImageOps

from retrain.errors import RetrainError
from retrain.fsutil import write_atomic

log = logging.getLogger(__name__)


#: pHash side: a 16x16 DCT block, 256 bits.  The 8x8 default (64 bits) cannot tell apart the consecutive frames of
#: a scene from two different synthetic scenes; at 256 bits frames of a moving scene stay within 32 bits of the
#: next while distinct pictures differ in 50 (generated) to 95 (coco128) bits or more (bench/RESULTS.md).
HASH_SIZE = 16
WORDS = HASH_SIZE * HASH_SIZE // 64


def phash(path: Path) -> int:
    """The 256-bit perceptual hash (DCT pHash, ``HASH_SIZE``) of an image as displayed (EXIF orientation applied).

    PIL's decompression-bomb limit stays on; a JPEG is decoded at reduced size (``draft``): pHash looks at 64x64.
    """
    with Image.open(path) as im:
        im.draft("L", (256, 256))
        gray = ImageOps.exif_transpose(im).convert("L")
        return int(str(imagehash.phash(gray, hash_size=HASH_SIZE)), 16)


def _words(value: int) -> list[int]:
    return [(value >> (64 * k)) & (2**64 - 1) for k in range(WORDS)]


class PhashCache:
    """pHash by the file's sha256 (a pure function of the bytes), kept in a JSON file under the workspace cache."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            doc = {}
        self.known: dict[str, str] = doc.get("hashes", {}) if doc.get("hash_size") == HASH_SIZE else {}
        self.added = 0

    def get(self, sha256: str, path: Path) -> int:
        """The image's pHash, computed once in the cache's life."""
        hit = self.known.get(sha256)
        if hit is not None:
            return int(hit, 16)
        value = phash(path)
        self.known[sha256] = f"{value:0{HASH_SIZE * HASH_SIZE // 4}x}"
        self.added += 1
        return value

    def save(self) -> None:
        """Write the cache when it learnt something."""
        if self.added:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps({"hash_size": HASH_SIZE, "hashes": self.known}, sort_keys=True))


@dataclass(frozen=True)
class Grouping:
    """Each image's group, and the images a linking arrival moved.

    Attributes:
        anchor: Per image (arrival order), the index of its group's anchor (its earliest member).
        arrival_anchor: Per image, its group's anchor when it arrived (before later images linked groups).
        by_sequence: Images joined to a group by a sequence id rather than (only) by their pHash.
    """

    anchor: tuple[int, ...]
    arrival_anchor: tuple[int, ...]
    by_sequence: int


def group_images(hashes: Sequence[int | None], sequences: Sequence[str | None], distance: int) -> Grouping:
    """Union-find over images in arrival order; a component's anchor is its earliest image.

    Args:
        hashes: Per image its pHash, or ``None`` (never grouped by appearance).
        sequences: Per image a sequence key (already scoped to its batch), or ``None``.
        distance: Hamming distance at or below which two pHashes are near-copies; negative: appearance is ignored.

    Returns:
        The grouping.
    """
    n = len(hashes)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(a: int, b: int) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    known = np.array([_words(h if h is not None else 0) for h in hashes], dtype=np.uint64).reshape(n, WORDS)
    has = np.array([h is not None for h in hashes], dtype=bool)
    first_of: dict[str, int] = {}
    arrival: list[int] = []
    by_sequence = 0
    for i in range(n):
        if distance >= 0 and has[i] and i:
            near = np.flatnonzero((np.bitwise_count(known[:i] ^ known[i]).sum(axis=1) <= distance) & has[:i])
            for j in near.tolist():
                union(j, i)
        seq = sequences[i]
        if seq is not None:
            first = first_of.setdefault(seq, i)
            if first != i and find(first) != find(i):
                union(first, i)
                by_sequence += 1
        arrival.append(find(i))
    return Grouping(tuple(find(i) for i in range(n)), tuple(arrival), by_sequence)


def hashes_for(shas: Sequence[str], files: Sequence[Path], names: Sequence[str], cache: PhashCache) -> list[int]:
    """Each image's pHash through ``cache``.

    Raises:
        RetrainError: An image cannot be read or decoded (named by ``names``): grouping it blindly could leak it.
    """
    out: list[int] = []
    try:
        for sha, path, name in zip(shas, files, names, strict=True):
            try:
                out.append(cache.get(sha, path))
            except (OSError, ValueError, Image.DecompressionBombError) as e:
                raise RetrainError(f"{name}: [near-copy] cannot be decoded for its perceptual hash ({e}); restore the "
                                   "batch with 'dvc checkout' (or 'dvc pull')") from e
    finally:
        cache.save()
    return out
