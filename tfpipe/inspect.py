"""Look inside TFRecord shards: schema, counts, label frequencies, a contact sheet, CRC checks.

    python -m tfpipe.inspect records/demo/train --sheet contact_sheet.png
    python -m tfpipe.inspect "gs://bucket/tfrecords/*.tfrec" --verify

Works on shards written by ``tfpipe.write`` and on TFRecords from elsewhere
(the schema is inferred from the records themselves).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import math
import posixpath
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TextIO, TypeAlias

import numpy as np

from tfpipe.format import schema
from tfpipe.format.shards import Records, Shards, open_shards, verify
from tfpipe.format.tfrecord import CorruptRecord, compressed, read_records
from tfpipe.runtime import fs
from tfpipe.runtime.errors import ArgumentParser, TfpipeError, check_count, option, run_cli

SCAN_RECORDS = 5000  # records read for the schema and label frequencies
SHEET_COLUMNS = 8
SHEET_TILE = 160  # pixels per contact-sheet tile
SHEET_GAP = 8  # grey pixels between tiles: captions and images never touch their neighbours'
SHEET_MARK = ("Software", "tfpipe.inspect contact sheet")  # a PNG text chunk: what a later --sheet may replace
CAPTION_SCALE = 0.45  # OpenCV Hershey font scale: ~9 px letters, legible at 100%
CAPTION_LINE = 18  # pixels per caption line
CAPTION_HEIGHT = 2 * CAPTION_LINE + 4  # two lines: the id, then the labels
CAPTION_CHARS = 40  # at most; a caption is then shortened until it fits the tile's width
IMAGE_MAGIC = (b"\xff\xd8", b"\x89PNG")
LABEL_KEYS = ("target", "label", "labels", "class")  # tried in order when --label-key is not given

# A parsed record: feature key -> (kind: "bytes_list", "float_list", "int64_list", None if the feature is empty;
# its values). A schema field: (kind, fewest values, most values, records holding the key).
Row: TypeAlias = dict[str, tuple[str | None, list[Any]]]
Field: TypeAlias = tuple[str | None, int, int, int]


def scan(shards: Shards, limit: int) -> tuple[list[Row], list[str]]:
    """Parses up to ``limit`` records as ``tf.train.Example`` (the schema's wire-identical classes, no TensorFlow).

    Returns (records as dicts key -> (kind, values), files that could not be read to the end of what was
    scanned). A file that holds something else than ``tf.train.Example`` records is an error naming it.
    """
    rows: list[Row] = []
    unreadable: list[str] = []
    for path in shards.files:
        try:
            for raw in itertools.islice(read_records(path), limit - len(rows)):
                rows.append(_parse(raw, path))
        except CorruptRecord:
            unreadable.append(path)
        if len(rows) >= limit:
            break
    return rows, unreadable


def _parse(raw: bytes, path: str) -> Row:
    example = schema.parse_record(raw, path)
    return {key: (feature.WhichOneof("kind"), _values(feature)) for key, feature in example.features.feature.items()}


def _values(feature: Any) -> list[Any]:
    kind = feature.WhichOneof("kind")
    return list(getattr(feature, kind).value) if kind else []


def infer_schema(records: Iterable[Row]) -> dict[str, Field]:
    """key -> (type, min length, max length, records holding it)."""
    out: dict[str, Field] = {}
    for row in records:
        for key, (kind, values) in row.items():
            t, lo, hi, n = out.get(key, (kind, len(values), len(values), 0))
            out[key] = (t, min(lo, len(values)), max(hi, len(values)), n + 1)
    return dict(sorted(out.items()))


def pick_keys(
    records: Sequence[Row], image_key: str | None = None, label_key: str | None = None
) -> tuple[str | None, str | None]:
    """Which feature holds the image and which the labels (ours, or guessed for foreign records)."""
    first = records[0] if records else {}
    if image_key is None:
        image_key = next(
            (k for k, (kind, v) in first.items() if kind == "bytes_list" and v and v[0][:4].startswith(IMAGE_MAGIC)),
            None,
        )
    if label_key is None:
        label_key = next((k for k in LABEL_KEYS if any(r.get(k, ("", []))[0] == "int64_list" for r in records)), None)
    return image_key, label_key


def label_frequencies(records: Iterable[Row], label_key: str) -> tuple[collections.Counter[int], int]:
    counts: collections.Counter[int] = collections.Counter()
    empty = 0
    for row in records:
        values = row.get(label_key, ("", []))[1]
        counts.update(values)
        empty += not values
    return counts, empty


def contact_sheet(
    rows: Sequence[Row],
    image_key: str,
    label_key: str | None,
    class_names: Sequence[str],
    count: int,
    labeled: bool = True,
) -> np.ndarray:
    """A grid of the first ``count`` images, each captioned with its id and its labels ("no labels" for an empty
    list, "unlabeled" for shards written without labels). Returns BGR uint8."""
    import cv2

    tiles: list[np.ndarray] = []
    for row in rows[:count]:
        data = row[image_key][1][0]
        img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        tile = np.zeros((SHEET_TILE + CAPTION_HEIGHT, SHEET_TILE, 3), np.uint8)
        if img is not None:
            tile[:SHEET_TILE] = cv2.resize(img, (SHEET_TILE, SHEET_TILE), interpolation=cv2.INTER_AREA)
        captions = (_caption_id(row), _caption_labels(row, label_key, class_names, labeled))
        for line, (text, keep) in enumerate(zip(captions, ("end", "start"))):
            cv2.putText(
                tile,
                _fitted(text, SHEET_TILE - 6, keep),
                (3, SHEET_TILE + CAPTION_LINE * (line + 1) - 4),
                cv2.FONT_HERSHEY_SIMPLEX,
                CAPTION_SCALE,
                (255, 255, 255) if line else (170, 200, 255),
                1,
                cv2.LINE_AA,
            )
        tiles.append(tile)
    while len(tiles) % SHEET_COLUMNS:
        tiles.append(np.zeros_like(tiles[0]))
    return _grid(tiles, SHEET_COLUMNS, SHEET_GAP)


def _grid(tiles: Sequence[np.ndarray], columns: int, gap: int) -> np.ndarray:
    """Tiles in rows of ``columns``, ``gap`` grey pixels between them and around the sheet."""
    h, w = tiles[0].shape[:2]
    rows = math.ceil(len(tiles) / columns)
    sheet = np.full((gap + rows * (h + gap), gap + columns * (w + gap), 3), 96, np.uint8)
    for i, tile in enumerate(tiles):
        y, x = gap + (i // columns) * (h + gap), gap + (i % columns) * (w + gap)
        sheet[y : y + h, x : x + w] = tile
    return sheet


def _fitted(text: str, width: int, keep: str) -> str:
    """``text`` shortened with ``..`` (keeping its ``end`` or its ``start``) until it fits ``width`` pixels."""
    import cv2

    def fits(t: str) -> bool:
        return cv2.getTextSize(t, cv2.FONT_HERSHEY_SIMPLEX, CAPTION_SCALE, 1)[0][0] <= width

    for n in range(len(text), 0, -1):
        short = text if n == len(text) else (".." + text[-n:] if keep == "end" else text[:n] + "..")
        if fits(short):
            return short
    return ""


def _caption_id(row: Row) -> str:
    """The record's id, shortened from the left (the end of a path or id is what tells images apart)."""
    name = row.get(schema.IMAGE_NAME, ("", [b""]))[1]
    text = (name[0] if name else b"").decode("utf-8", "replace") or "(no id)"
    return text if len(text) <= CAPTION_CHARS else ".." + text[-(CAPTION_CHARS - 2) :]


def _caption_labels(row: Row, label_key: str | None, class_names: Sequence[str], labeled: bool) -> str:
    if not labeled or not label_key:
        return "unlabeled"
    labels = row.get(label_key, ("", []))[1]
    # ", " between labels: "5, 6" is two labels, where "5 6" read like "56" at caption size
    text = ", ".join(class_names[v] if 0 <= v < len(class_names) else str(v) for v in labels) or "no labels"
    return text if len(text) <= CAPTION_CHARS else text[: CAPTION_CHARS - 2] + ".."


def save_sheet(image: np.ndarray, path: str) -> None:
    """Writes a BGR contact sheet as a PNG carrying ``SHEET_MARK``, so a later ``--sheet`` may replace it."""
    import io

    from PIL import Image, PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text(*SHEET_MARK)
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image[..., ::-1])).save(buffer, "PNG", pnginfo=info)
    fs.write_atomic(path, buffer.getvalue())


def check_sheet(path: str) -> None:
    """``--sheet`` replaces only a contact sheet written before, never a file named by mistake (``--sheet
    train.csv``) or a user's own ``contact_sheet.png`` in the working folder."""
    if fs.isdir(path):
        raise TfpipeError(f"{path} is a folder; {option('sheet')} names the PNG file to write")
    if fs.exists(path) and not _is_sheet(path):
        raise TfpipeError(
            f"{path} exists and is not a contact sheet tfpipe.inspect wrote; it is not replaced -- "
            f"remove it, choose another {option('sheet')} or pass {option('no_sheet', True, python='sheet=None')}"
        )


def _is_sheet(path: str) -> bool:
    from PIL import Image, PngImagePlugin, UnidentifiedImageError

    try:
        with fs.open(path, "rb") as f, Image.open(f) as image:
            return isinstance(image, PngImagePlugin.PngImageFile) and image.text.get(SHEET_MARK[0]) == SHEET_MARK[1]
    except (UnidentifiedImageError, OSError, ValueError):
        return False


def inspect_shards(
    records: Records,
    *,
    scan_records: int = SCAN_RECORDS,
    sheet: str | None = None,
    sheet_count: int = 32,
    do_verify: bool = False,
    image_key: str | None = None,
    label_key: str | None = None,
    stream: TextIO | None = None,
) -> dict[str, Any]:
    """Prints what the shards hold; optionally writes a contact sheet and verifies every record.

    Args:
      records: a shard folder, glob pattern or list of files (local or ``gs://``).
      scan_records: records read for the schema, label counts and the sheet.
      sheet: contact-sheet PNG to write, or None.
      sheet_count: images on the sheet.
      do_verify: read every record, check CRCs and counts (raises on a problem).
      image_key: the feature holding the encoded image (default: guessed).
      label_key: the int64 feature holding the labels (default: guessed).
      stream: where to print (default: ``sys.stdout`` at the time of the call).

    Returns a dict with ``files``, ``schema``, ``label_counts`` and ``problems``.

    Raises:
      TfpipeError: when ``do_verify`` finds a corrupt, truncated or miscounted shard.
    """
    check_count(1, scan_records=scan_records, sheet_count=sheet_count)
    stream = stream or sys.stdout
    if sheet:
        check_sheet(sheet)
    shards = open_shards(records, any_schema=True)  # inspect also reads other writers' records
    rows, unreadable = scan(shards, scan_records)
    fields = infer_schema(rows)
    image_key, label_key = pick_keys(rows, image_key, label_key)
    classes = shards.classes or []
    print_files(records, shards, stream)
    print_schema(fields, len(rows), image_key, label_key, stream)
    counts = print_labels(rows, label_key, classes, stream) if label_key else collections.Counter[int]()
    for f in unreadable:
        why = compressed(f) or "corrupt or truncated (run with --verify)"
        print(f"  WARNING {posixpath.basename(f)}: {why}", file=stream)
    if sheet and image_key and rows:
        save_sheet(contact_sheet(rows, image_key, label_key, classes, sheet_count, shards.labeled), sheet)
        print(f"contact sheet: {sheet}", file=stream)
    problems = verify_and_report(shards, stream) if do_verify else []
    return {
        "files": list(shards.files),
        "schema": fields,
        "label_counts": dict(counts),
        "problems": problems,
        "image_key": image_key,
        "label_key": label_key,
    }


def print_files(records: Records, shards: Shards, stream: TextIO) -> None:
    counts = shards.counts
    manifest = shards.manifest
    folds = f", {manifest.num_folds} folds" if manifest and manifest.num_folds else ""
    folds += f" by group {manifest.group_column!r}" if manifest and manifest.group_column else ""
    print(
        f"{records}: {len(shards.files)} files, {sum(c or 0 for c in counts.values())} records{folds}"
        f"{' (manifest)' if manifest else ''}",
        file=stream,
    )
    for f, n in counts.items():
        print(f"  {posixpath.basename(f)}: {n if n is not None else '?'} records", file=stream)


def print_schema(
    fields: Mapping[str, Field], scanned: int, image_key: str | None, label_key: str | None, stream: TextIO
) -> None:
    print(f"schema (from {scanned} records):", file=stream)
    for key, (kind, lo, hi, n) in fields.items():
        length = f"{lo}" if lo == hi else f"{lo}..{hi}"
        mark = " <- image" if key == image_key else " <- labels" if key == label_key else ""
        kind = (kind or "none").replace("_list", "")  # None: a feature holding no value list at all
        print(f"  {key}: {kind} x {length}{'' if n == scanned else f' in {n}'}{mark}", file=stream)


def print_labels(
    rows: Sequence[Row], label_key: str, classes: Sequence[str], stream: TextIO
) -> collections.Counter[int]:
    counts, empty = label_frequencies(rows, label_key)
    print(f"labels (over {len(rows)} records; {empty} with none):", file=stream)
    for value, n in sorted(counts.items()):
        name = classes[value] if 0 <= value < len(classes) else str(value)
        print(f"  {value:>4} {name}: {n}", file=stream)
    return counts


def verify_and_report(shards: Shards, stream: TextIO) -> list[str]:
    """``verify`` with one line per problem; raises naming the bad shards."""
    problems = verify(shards)
    for p in problems:
        print(f"  BAD {p}", file=stream)
    if problems:
        raise TfpipeError(
            f"{len(problems)} of {len(shards.files)} shards failed verification: "
            + "; ".join(p.split(":")[0] for p in problems)
        )
    print(f"verified: {len(shards.files)} files, every record read and CRC-checked, counts match", file=stream)
    return problems


def run_command(args: argparse.Namespace) -> None:
    inspect_shards(
        args.records,
        scan_records=args.scan_records,
        sheet=None if args.no_sheet else args.sheet,
        sheet_count=args.sheet_count,
        do_verify=args.verify,
        image_key=args.image_key,
        label_key=args.label_key,
    )


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m tfpipe.inspect", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("records", help="shard folder, glob pattern or file (local or gs://)")
    p.add_argument("--verify", action="store_true", help="read every record (CRC) and check counts; exit 2 if bad")
    p.add_argument("--sheet", default="contact_sheet.png", help="contact sheet PNG")
    p.add_argument("--no-sheet", action="store_true", help="do not write a contact sheet")
    p.add_argument("--sheet-count", type=int, default=32, help="images on the sheet")
    p.add_argument("--scan-records", type=int, default=SCAN_RECORDS, help="records scanned")
    p.add_argument("--image-key", help="feature holding the encoded image (default: guessed)")
    p.add_argument("--label-key", help="int64 feature holding the labels (default: target/label/labels/class)")
    return p


def main(argv: Sequence[str] | None = None) -> int:

    return run_cli("tfpipe.inspect", run_command, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
