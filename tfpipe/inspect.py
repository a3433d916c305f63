"""Look inside TFRecord shards: schema, counts, label frequencies, a contact sheet, CRC checks.

    python -m tfpipe.inspect records/demo/train --sheet contact_sheet.png
    python -m tfpipe.inspect "gs://bucket/tfrecords/*.tfrec" --verify

Works on shards written by ``tfpipe.write`` and on TFRecords from elsewhere
(the schema is inferred from the records themselves).
"""
import argparse
import collections
import posixpath
import sys

import numpy as np

from tfpipe.deps import require
from tfpipe.errors import TfpipeError, run_cli

SCAN_RECORDS = 5000  # records read for the schema and label frequencies
SHEET_COLUMNS = 8
SHEET_TILE = 128  # pixels per contact-sheet tile
CAPTION_HEIGHT = 16
IMAGE_MAGIC = (b"\xff\xd8", b"\x89PNG")
LABEL_KEYS = ("target", "label", "labels", "class")  # tried in order when --label-key is not given


def find_shards(path):
    """(files sorted by name, manifest or None) for a folder, glob pattern or single file."""
    tf = require("tensorflow")

    from tfpipe.shards import MANIFEST, read_manifest

    if tf.io.gfile.isdir(path):
        manifest = read_manifest(path) if tf.io.gfile.exists(posixpath.join(path, MANIFEST)) else None
        files = sorted(tf.io.gfile.glob(posixpath.join(path, "*.tfrec*")))
        if manifest:
            files = sorted(posixpath.join(path, s["file"]) for s in manifest["shards"])
    else:
        manifest, files = None, sorted(tf.io.gfile.glob(path))
    if not files:
        raise TfpipeError(f"{path}: no TFRecord files found")
    return files, manifest


def scan(files, limit):
    """Parses up to ``limit`` records with TensorFlow's own Example proto.

    Returns (records as dicts key -> (kind, values), names of files that could
    not be read to the end of what was scanned).
    """
    tf = require("tensorflow")

    records, unreadable = [], []
    for f in files:
        if len(records) >= limit:
            break
        try:
            for raw in tf.data.TFRecordDataset(f).take(limit - len(records)).as_numpy_iterator():
                example = tf.train.Example.FromString(raw)
                records.append({key: (feature.WhichOneof("kind"), _values(feature))
                                for key, feature in example.features.feature.items()})
        except tf.errors.DataLossError:
            unreadable.append(f)
    return records, unreadable


def _values(feature):
    kind = feature.WhichOneof("kind")
    return list(getattr(feature, kind).value) if kind else []


def infer_schema(records):
    """key -> (type, min length, max length, records holding it)."""
    out = {}
    for row in records:
        for key, (kind, values) in row.items():
            t, lo, hi, n = out.get(key, (kind, len(values), len(values), 0))
            out[key] = (t, min(lo, len(values)), max(hi, len(values)), n + 1)
    return dict(sorted(out.items()))


def pick_keys(records, image_key=None, label_key=None):
    """Which feature holds the image and which the labels (ours, or guessed for foreign records)."""
    first = records[0] if records else {}
    if image_key is None:
        image_key = next((k for k, (kind, v) in first.items()
                          if kind == "bytes_list" and v and v[0][:4].startswith(IMAGE_MAGIC)), None)
    if label_key is None:
        label_key = next((k for k in LABEL_KEYS if any(r.get(k, ("", []))[0] == "int64_list" for r in records)),
                         None)
    return image_key, label_key


def label_frequencies(records, label_key):
    counts, empty = collections.Counter(), 0
    for row in records:
        values = row.get(label_key, ("", []))[1]
        counts.update(values)
        empty += not values
    return counts, empty


def verify(files, expected):
    """Reads every record of every file (CRC-checked). Returns a list of problems, one line each."""
    tf = require("tensorflow")

    problems = []
    for f in files:
        n = 0
        try:
            for _ in tf.data.TFRecordDataset(f):
                n += 1
        except (tf.errors.DataLossError, tf.errors.OutOfRangeError) as e:
            problems.append(f"{f}: corrupt or truncated after {n} records ({e.message.splitlines()[0]})")
            continue
        if expected[f] is not None and n != expected[f]:
            problems.append(f"{f}: holds {n} records, expected {expected[f]}")
    return problems


def contact_sheet(records, image_key, label_key, class_names, count):
    """A grid of the first ``count`` images, each captioned with its labels. Returns BGR uint8."""
    import cv2

    tiles = []
    for row in records[:count]:
        data = row[image_key][1][0]
        img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        tile = np.zeros((SHEET_TILE + CAPTION_HEIGHT, SHEET_TILE, 3), np.uint8)
        if img is not None:
            tile[:SHEET_TILE] = cv2.resize(img, (SHEET_TILE, SHEET_TILE), interpolation=cv2.INTER_AREA)
        labels = row.get(label_key, ("", []))[1] if label_key else []
        text = " ".join(class_names[v] if 0 <= v < len(class_names) else str(v) for v in labels) or "-"
        cv2.putText(tile, text[:24], (2, SHEET_TILE + 12), cv2.FONT_HERSHEY_SIMPLEX, 0.35, (255, 255, 255), 1,
                    cv2.LINE_AA)
        tiles.append(tile)
    while len(tiles) % SHEET_COLUMNS:
        tiles.append(np.zeros_like(tiles[0]))
    rows = [np.hstack(tiles[i:i + SHEET_COLUMNS]) for i in range(0, len(tiles), SHEET_COLUMNS)]
    return np.vstack(rows)


def save_png(image, path):
    import cv2
    tf = require("tensorflow")

    with tf.io.gfile.GFile(path, "wb") as f:
        f.write(cv2.imencode(".png", image)[1].tobytes())


def inspect_shards(path, *, scan_records=SCAN_RECORDS, sheet=None, sheet_count=32, do_verify=False, image_key=None,
            label_key=None, out=sys.stdout):
    """Prints what the shards hold; optionally writes a contact sheet and verifies every record.

    Returns a dict with ``files``, ``schema``, ``label_counts`` and ``problems``.

    Raises:
      TfpipeError: when ``do_verify`` finds a corrupt, truncated or miscounted shard.
    """
    from tfpipe.read import shard_counts

    files, manifest = find_shards(path)
    expected = shard_counts(files, manifest)
    records, unreadable = scan(files, scan_records)
    fields = infer_schema(records)
    image_key, label_key = pick_keys(records, image_key, label_key)
    classes = (manifest or {}).get("classes") or []
    print(f"{path}: {len(files)} files, {sum(c or 0 for c in expected.values())} records"
          f"{' (manifest)' if manifest else ''}", file=out)
    for f in files:
        print(f"  {posixpath.basename(f)}: {expected[f] if expected[f] is not None else '?'} records", file=out)
    print(f"schema (from {len(records)} records):", file=out)
    for key, (kind, lo, hi, n) in fields.items():
        length = f"{lo}" if lo == hi else f"{lo}..{hi}"
        mark = " <- image" if key == image_key else " <- labels" if key == label_key else ""
        print(f"  {key}: {kind.replace('_list', '')} x {length}{'' if n == len(records) else f' in {n}'}{mark}",
              file=out)
    counts, empty = label_frequencies(records, label_key) if label_key else (collections.Counter(), 0)
    if label_key:
        print(f"labels (over {len(records)} records; {empty} with none):", file=out)
        for value, n in sorted(counts.items()):
            name = classes[value] if 0 <= value < len(classes) else str(value)
            print(f"  {value:>4} {name}: {n}", file=out)
    for f in unreadable:
        print(f"  WARNING {posixpath.basename(f)}: corrupt or truncated (run with --verify)", file=out)
    if sheet and image_key and records:
        save_png(contact_sheet(records, image_key, label_key, classes, sheet_count), sheet)
        print(f"contact sheet: {sheet}", file=out)
    problems = verify(files, expected) if do_verify else []
    if do_verify:
        for p in problems:
            print(f"  BAD {p}", file=out)
        if problems:
            raise TfpipeError(f"{len(problems)} of {len(files)} shards failed verification: "
                              + "; ".join(p.split(":")[0] for p in problems))
        print(f"verified: {len(files)} files, every record read and CRC-checked, counts match", file=out)
    return {"files": files, "schema": fields, "label_counts": dict(counts), "problems": problems,
            "image_key": image_key, "label_key": label_key}


def run(args):
    inspect_shards(args.path, scan_records=args.scan, sheet=None if args.no_sheet else args.sheet,
            sheet_count=args.sheet_count, do_verify=args.verify, image_key=args.image_key, label_key=args.label_key)


def main(argv=None):
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    p = argparse.ArgumentParser(prog="python -m tfpipe.inspect", description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="shard folder, glob pattern or file (local or gs://)")
    p.add_argument("--verify", action="store_true", help="read every record (CRC) and check counts; exit 2 if bad")
    p.add_argument("--sheet", default="contact_sheet.png", help="contact sheet PNG (default: contact_sheet.png)")
    p.add_argument("--no-sheet", action="store_true", help="do not write a contact sheet")
    p.add_argument("--sheet-count", type=int, default=32, help="images on the sheet (default: 32)")
    p.add_argument("--scan", type=int, default=SCAN_RECORDS, help=f"records scanned (default: {SCAN_RECORDS})")
    p.add_argument("--image-key", help="feature holding the encoded image (default: guessed)")
    p.add_argument("--label-key", help="int64 feature holding the labels (default: target/label/labels/class)")
    return run_cli("tfpipe.inspect", run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
