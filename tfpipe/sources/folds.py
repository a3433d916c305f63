"""Multi-label stratified K-fold assignment (iterative stratification), by image or by group."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from tfpipe.format.schema import multi_hot
from tfpipe.runtime.errors import TfpipeError, check_count, option


def assign_folds(
    targets: Sequence[Sequence[int]],
    num_classes: int,
    k: int,
    seed: int = 0,
    groups: Sequence[str] | None = None,
    copies: Sequence[int] | None = None,
) -> list[int]:
    """Gives every record a fold in [0, k) so each fold has a similar label mix.

    Uses ``iterstrat.MultilabelStratifiedKFold`` (Sechidis et al. 2011), which
    balances every label's frequency across folds; records with an empty
    label list are balanced as if "no label" were one more class. With ``groups``
    (one per record: the patient, video or site an image comes from) every record
    of a group gets one fold (``_grouped``): validation never sees a group it
    trained on (Kaggle's GroupKFold practice), at the price of a less even balance
    where groups are large (``fold_balance`` measures it).

    With ``copies`` (one per record: the index of the first record of the same bytes, its own index when unique;
    ``tfpipe.writer.copies.source_copies``) every copy gets its first's fold: groups that share an image are joined
    (``merge_groups``); without groups the unique images are stratified, each by the labels any of its copies
    has (for the balance only: no record's labels change). Without any copy the folds are those drawn without
    ``copies``.

    Returns:
      A list of fold numbers, one per record, in input order.
    """
    n = len(targets)
    check_count(2, num_folds=k)
    if k > n:
        raise TfpipeError(f"{option('num_folds', k)} is more than the {n} images")
    y = multi_hot(targets, num_classes, np.int8)
    y = np.concatenate([y, (y.sum(axis=1, keepdims=True) == 0)], axis=1)  # stratify "no label" like a class
    if groups is not None:
        joined = merge_groups(groups, copies).groups if copies is not None else groups
        return _grouped(y, joined, k, seed).tolist()
    if copies is None or all(first == i for i, first in enumerate(copies)):
        return _stratified(y, k, seed).tolist()
    firsts, copy_of = np.unique(np.asarray(copies), return_inverse=True)  # firsts in input order
    if k > len(firsts):
        raise TfpipeError(
            f"{option('num_folds', k)} is more than the {len(firsts)} distinct images ({n - len(firsts)} of the "
            f"{n} are byte-identical copies, kept in the fold of the image they copy)"
        )
    labels = np.zeros((len(firsts), y.shape[1] - 1), np.int8)
    np.maximum.at(labels, copy_of, y[:, :-1])  # a content's labels: those any of its copies has
    unique = np.concatenate([labels, (labels.sum(axis=1, keepdims=True) == 0)], axis=1)
    return _stratified(unique, k, seed)[copy_of].tolist()


@dataclasses.dataclass(frozen=True)
class MergedGroups:
    """Groups joined where a byte-identical image links them: every record's group (a joined set under the name of
    its first group in input order), how many groups were joined and into how many."""

    groups: list[str]
    merged: int
    into: int


def merge_groups(groups: Sequence[str], copies: Sequence[int]) -> MergedGroups:
    """Joins the groups of every record and the record it copies (``copies``: as ``assign_folds`` takes them), and
    the groups joined to those (union-find), so one content never sits in two groups' folds."""
    parent: dict[str, str] = {}
    first_seen = {group: i for i, group in reversed(list(enumerate(groups)))}  # each group's first record

    def root(group: str) -> str:
        while parent.setdefault(group, group) != group:
            parent[group] = parent[parent[group]]  # path halving
            group = parent[group]
        return group

    for i, first in enumerate(copies):
        a, b = sorted((root(groups[first]), root(groups[i])), key=first_seen.__getitem__)
        if a != b:  # the group seen first names the joined set
            parent[b] = a
    joined = [root(group) for group in groups]
    members = {group: root(group) for group in set(groups)}
    sizes = np.unique(list(members.values()), return_counts=True)[1]
    return MergedGroups(joined, int(sizes[sizes > 1].sum()), int((sizes > 1).sum()))


def _grouped(y: np.ndarray, groups: Sequence[str], k: int, seed: int) -> np.ndarray:
    """The fold of each row of the multi-hot ``y``, every row of a group in one fold: groups largest first (ties
    in an order drawn from ``seed``), each to the fold where it leaves the class counts and the fold sizes most
    even (the least spread over folds, summed over classes, of each class's share); the most even of
    ``GROUP_TRIES`` such passes. This is the greedy of
    scikit-learn's ``StratifiedGroupKFold``, which is single-label only; stratifying the groups with iterstrat
    instead, each by the labels any of its images has, ignores their sizes: on three synthetic sets of about 1,600
    images in 260 groups of 1-11 (tests/test_group_folds.py) its worst class is 27-38% off an even share in some
    fold, this 2.0-3.7% (iterstrat without groups: 1.6%)."""
    names, group_of = np.unique(np.asarray(groups, dtype=object).astype(str), return_inverse=True)
    k_groups = len(names)
    if k_groups < k:
        raise TfpipeError(
            f"{option('num_folds', k)} needs at least {k} groups, and the images come from {k_groups}: "
            "a group is never split between folds"
        )
    counts = np.zeros((k_groups, y.shape[1]), np.int64)
    np.add.at(counts, group_of, y)  # each group's images per class
    size = np.bincount(group_of, minlength=k_groups)
    rng = np.random.default_rng(seed)
    tries = [_greedy(counts, size, k, np.lexsort((rng.random(k_groups), -size))) for _ in range(GROUP_TRIES)]
    best, _ = min(tries, key=lambda t: t[1])
    return best[group_of]


GROUP_TRIES = 8  # greedy passes in different orders of equal-sized groups; the most even one is kept


def _greedy(counts: np.ndarray, size: np.ndarray, k: int, order: np.ndarray) -> tuple[np.ndarray, float]:
    """One pass of ``_grouped`` over the groups in ``order``: (the fold of each group, the final spread)."""
    total = np.maximum(counts.sum(axis=0), 1).astype(float)
    per_fold, fold_sizes = np.zeros((k, counts.shape[1])), np.zeros(k)
    fold_of_group = np.zeros(len(size), np.int64)
    choices = np.eye(k)
    spread = np.zeros(k)
    for g in order:
        classes_after = (per_fold[None] + choices[:, :, None] * counts[g]) / total  # [choice, fold, class]
        sizes_after = (fold_sizes[None] + choices * size[g]) / size.sum()
        spread = classes_after.std(axis=1).sum(axis=1) + sizes_after.std(axis=1)
        fold = int(np.argmin(spread + 1e-12 * fold_sizes))  # a tie: the smaller fold
        fold_of_group[g] = fold
        per_fold[fold] += counts[g]
        fold_sizes[fold] += size[g]
    return fold_of_group, float(spread.min())


def _stratified(y: np.ndarray, k: int, seed: int) -> np.ndarray:
    """The fold of each row of the multi-hot ``y``."""
    from iterstrat.ml_stratifiers import MultilabelStratifiedKFold

    folds = np.zeros(len(y), np.int64)
    splitter = MultilabelStratifiedKFold(n_splits=k, shuffle=True, random_state=seed)
    for fold, (_, val) in enumerate(splitter.split(np.zeros((len(y), 1)), y)):
        folds[val] = fold
    return folds


@dataclasses.dataclass(frozen=True)
class Balance:
    """How evenly folds split the images: the smallest and largest fold, and the class whose count in some fold
    is furthest from an even share (its count / k), as that distance over the share."""

    smallest: int
    largest: int
    worst_class: int | None  # None: no class has as many images as folds
    worst_fold: int
    deviation: float


def fold_balance(targets: Sequence[Sequence[int]], folds: Sequence[int], num_classes: int, k: int) -> Balance:
    """The achieved balance of ``folds`` over ``targets`` (classes with fewer images than folds left out: they
    cannot be in every fold)."""
    y = multi_hot(targets, num_classes, np.int64)
    fold_of = np.asarray(folds)
    sizes = np.bincount(fold_of, minlength=k)
    per_fold = np.stack([y[fold_of == f].sum(axis=0) for f in range(k)])  # [k, classes]
    share = y.sum(axis=0) / k
    counted = share >= 1
    if not counted.any():
        return Balance(int(sizes.min()), int(sizes.max()), None, 0, 0.0)
    off = np.where(counted, np.abs(per_fold - share) / np.maximum(share, 1e-9), 0.0)
    fold, c = np.unravel_index(int(np.argmax(off)), off.shape)
    return Balance(int(sizes.min()), int(sizes.max()), int(c), int(fold), float(off[fold, c]))
