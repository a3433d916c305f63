"""Write a Kaggle-style image folder + CSV as sharded TFRecords.

    python -m tfpipe.write --csv data/demo/train.csv --images data/demo/images \
        --out records/demo/train --image-size 128 --folds 5

Steps: read the source (CSV or folder-per-class) -> fix the classes -> assign
folds -> plan shards -> decode/resize/encode/serialize in a torch DataLoader
-> write shards in input order under staging names -> rename them into place
and write ``manifest.json``. See ``python -m tfpipe.write --help``.
"""
import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time

from tfpipe import __version__, fs, schema
from tfpipe.deps import require
from tfpipe.errors import TfpipeError, run_cli
from tfpipe.images import FITS, FORMATS, ImageSpec, prepare_image
from tfpipe.shards import (MANIFEST, StagedShards, existing_shards, num_shards, plan)
from tfpipe.sources import LabelFormat, class_names, read_csv, read_folder_tree, resolve_images, targets
from tfpipe.tfds_source import TfdsSource, read_tfds

RUNNERS = ("local", "beam")
LOADER_BATCH = 16  # images per DataLoader batch: amortises inter-process overhead
EST_BYTES_PER_PIXEL = {"jpeg": 0.5, "png": 2.0}  # for shard planning before any image is encoded
MAX_LISTED_SKIPS = 5  # how many skipped files the summary line names


@dataclasses.dataclass(frozen=True)
class Source:
    """What to read. ``csv=None`` reads ``images`` as a folder per class (or, for an
    unlabeled split, a flat folder of images)."""

    images: str
    csv: str | None = None
    image_col: str = "image"
    label_format: LabelFormat = LabelFormat()
    labeled: bool = True


def collect_items(source, skip_bad):
    """Returns (items, skipped) for a ``Source``; missing images are errors unless skipped."""
    if source.csv is None:
        if source.labeled:
            return read_folder_tree(source.images), []
        if not fs.isdir(source.images):
            raise TfpipeError(f"{source.images}: images folder not found")
        rows = [(i + 1, f, ()) for i, f in enumerate(sorted(fs.listdir(source.images)))
                if not f.startswith(".") and fs.isfile(fs.join(source.images, f))]
        csv_name = source.images
    else:
        rows = read_csv(source.csv, image_col=source.image_col, label_format=source.label_format,
                        labeled=source.labeled)
        csv_name = source.csv
    items, missing = resolve_images(rows, source.images, csv_name)
    if missing and not skip_bad:
        row, name = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise TfpipeError(f"{csv_name}: row {row}: image {name!r} not found in {source.images}{more}")
    skipped = [{"image": name, "reason": "file not found"} for _, name in missing]
    if not items:
        raise TfpipeError(f"{csv_name}: no images to write")
    return items, skipped


def encode_item(item, target, spec):
    """One image to one serialized record: read, decode, resize, encode, serialize.

    Returns (record, None), or (None, error message) for a problem with the
    user's data, so the caller applies the error policy (stop, or skip and
    report) in input order. Used by the DataLoader workers and the Beam runner.
    """
    try:
        if item.data is not None:  # e.g. from TFDS
            data = item.data
        else:
            with fs.open(item.path, "rb") as f:
                data = f.read()
        image, height, width, _ = prepare_image(data, spec, item.path)
    except TfpipeError as e:
        return None, str(e)
    except OSError as e:
        return None, f"{item.path}: cannot read ({e.strerror or e})"
    except Exception as e:  # tf.errors.* from tf.io.gfile for remote inputs
        if not type(e).__module__.startswith("tensorflow"):
            raise
        return None, f"{item.path}: cannot read ({type(e).__name__})"
    values = {schema.IMAGE: image, schema.IMAGE_NAME: item.name, schema.HEIGHT: height, schema.WIDTH: width}
    if target is not None:
        values[schema.TARGET] = target
    return schema.encode_example(values), None


class EncodeDataset:
    """Map-style dataset for the DataLoader: index -> (index, record bytes, error), run in worker processes."""

    def __init__(self, items, item_targets, spec, start=0):
        self.items, self.targets, self.spec, self.start = items, item_targets, spec, start

    def __len__(self):
        return len(self.items) - self.start

    def __getitem__(self, i):
        i += self.start  # --resume: records of finished shards are not encoded again
        return (i, *encode_item(self.items[i], None if self.targets is None else self.targets[i], self.spec))


def _keep_batch(batch):
    return batch  # a list of (index, record, error); no tensors involved


def _worker_init(_):
    import cv2

    cv2.setNumThreads(1)  # one process per core already; OpenCV threads would oversubscribe


def start_encoding(dataset, num_workers, start_method):
    """Starts DataLoader workers and returns an iterator of batches in input order.

    Each batch is a list of (index, record, error). The workers start (and
    begin encoding) at once, so their start-up overlaps the main process's own
    (importing TensorFlow, for remote output only). ``start_method="auto"`` forks
    while TensorFlow is not yet imported here (fast: nothing to re-import) and
    otherwise spawns, because a fork of a process where TensorFlow runs threads
    can hang (e.g. in a notebook that already trained a model).
    """
    DataLoader = require("torch.utils.data").DataLoader  # noqa: N806  (torch: the [write] extra)

    if start_method == "auto":
        remote = fs.is_remote(dataset.items[0].path) if dataset.items else False  # workers then use TensorFlow
        start_method = "spawn" if "tensorflow" in sys.modules or remote else "fork"

    loader = DataLoader(dataset, batch_size=LOADER_BATCH, shuffle=False, num_workers=num_workers,
                        collate_fn=_keep_batch, worker_init_fn=_worker_init if num_workers else None,
                        multiprocessing_context=start_method if num_workers else None,
                        prefetch_factor=4 if num_workers else None)
    return iter(loader)


def default_workers(items, spec):
    """One worker per core, except when JPEGs will mostly be copied as they are (no ``--image-size``):
    then there is no codec work to spread, and moving each file's bytes through a worker process costs
    more than it saves (measured: 700 vs 490 images/s on 2 cores)."""
    if spec.size is None and spec.format == "jpeg" and all(
            item.path.lower().endswith((".jpg", ".jpeg")) for item in items):
        return 0
    return os.cpu_count()


def estimate_bytes(items, spec):
    if spec.size is None:
        return sum(len(item.data) if item.data is not None else fs.size(item.path) for item in items)
    return int(len(items) * spec.size * spec.size * EST_BYTES_PER_PIXEL[spec.format])


def job_fingerprint(items, item_targets, names, shard_plan, spec, split):
    """A hash of everything that decides the output bytes, so --resume never mixes two different jobs."""
    h = hashlib.sha256(json.dumps([split, names, dataclasses.asdict(spec), shard_plan, schema.describe()]).encode())
    for i, item in enumerate(items):
        h.update(f"{item.name}\0{item.path}\0{list(item_targets[i]) if item_targets else ''}\n".encode())
    return h.hexdigest()


def shutdown(batches):
    """Stops DataLoader workers now (Ctrl-C, errors) instead of whenever the iterator is collected."""
    stop = getattr(batches, "_shutdown_workers", None)
    if stop is not None:
        stop()


def write_shards(out, source, *, spec=ImageSpec(), classes=None, split="train", shards=None, folds=None,
                 seed=0, skip_bad=False, overwrite=False, resume=False, num_workers=None, start_method="auto",
                 progress=True, runner="local", pipeline_args=()):
    """Writes a source as sharded TFRecords plus ``manifest.json`` into ``out``.

    Example::

        from tfpipe.write import Source, write_shards
        manifest = write_shards("records/train", Source("images", csv="train.csv"), folds=5)

    Args:
      out: output folder, local or ``gs://``.
      source: a ``Source``.
      spec: an ``ImageSpec`` (size, fit, format, quality).
      classes: class names in index order, or None for sorted unique labels.
      split: name prefix of the shards; a split written with an unlabeled
        ``Source`` has no ``target`` feature.
      shards: number of shards (default: a multiple of 8 giving ~150 MB shards).
      folds: K for stratified K-fold assignment; shards never mix folds.
      seed: seed of the fold assignment.
      skip_bad: skip unreadable or missing images (listed in the manifest) instead of stopping.
      overwrite: replace shards already in ``out``.
      resume: continue an interrupted write of the same job into ``out``: shards
        it finished are kept, the rest are written; the result is identical to
        an uninterrupted write.
      num_workers: DataLoader workers (default: CPU count; 0 runs in this process, the default when
        every input is a JPEG and no ``spec.size`` is set, i.e. bytes are mostly copied as they are).
      start_method: "auto" (fork unless TensorFlow is already imported, else
        spawn), or a multiprocessing start method.
      progress: show a tqdm progress bar.
      runner: "local" (a torch DataLoader on this machine) or "beam" (Apache Beam;
        see ``tfpipe.beam``): same records, same shards, same manifest.
      pipeline_args: Beam pipeline options for ``runner="beam"``.

    Returns:
      The manifest (a dict).
    """
    from tqdm import tqdm

    started = time.perf_counter()
    if isinstance(source, TfdsSource):
        items, tfds_classes, single_label = read_tfds(source)
        skipped, classes = [], classes or tfds_classes or None
    else:
        items, skipped = collect_items(source, skip_bad)
        single_label = source.label_format.single_label
    labeled = source.labeled
    names = class_names(items, classes) if labeled else list(classes or [])
    item_targets = targets(items, names) if labeled else None
    fold_of = _folds(item_targets, len(names), folds, seed) if folds else [0] * len(items)
    order = sorted(range(len(items)), key=lambda i: fold_of[i])  # stable: input order within a fold
    items = [items[i] for i in order]
    item_targets = [item_targets[i] for i in order] if labeled else None
    fold_sizes = [fold_of.count(f) for f in range(folds or 1)]
    shard_plan = plan(fold_sizes, num_shards(len(items), estimate_bytes(items, spec), shards))
    shard_of = [s["index"] for s in shard_plan for _ in range(s["size"])]
    last_of_shard = {s["start"] + s["size"] - 1: s["index"] for s in shard_plan}
    fingerprint = job_fingerprint(items, item_targets, names, shard_plan, spec, split)

    if runner not in RUNNERS:
        raise TfpipeError(f"unknown runner {runner!r}: use {' or '.join(RUNNERS)}")
    if runner == "beam" and resume:
        raise TfpipeError("--resume works with the default runner; with --runner beam run the job again "
                          "(Beam runners retry failed work themselves)")
    beam_options = _beam_options(pipeline_args) if runner == "beam" else None  # refuse bad options before work
    workers = default_workers(items, spec) if num_workers is None else num_workers
    # Start the workers first (before this process may import TensorFlow for gs:// output, so they can fork);
    # a resumed write must first learn from the staging folder where to start.
    batches = None
    if runner == "local" and not resume:
        batches = start_encoding(EncodeDataset(items, item_targets, spec), workers, start_method)
    try:
        _check_output(out, overwrite or resume)
        with StagedShards(out, split, shard_plan, fingerprint, resume=resume) as staged:
            if runner == "beam":
                _write_with_beam(staged, items, item_targets, spec, shard_plan, skip_bad, beam_options)
            else:
                start = staged.first_unfinished_record()
                if batches is None:
                    batches = start_encoding(EncodeDataset(items, item_targets, spec, start), workers, start_method)
                try:
                    _write_records(batches, staged, items, shard_of, last_of_shard, skip_bad,
                                   tqdm(total=len(items), initial=start, unit="img", disable=not progress,
                                        desc=f"write {split}"))
                except KeyboardInterrupt:
                    raise KeyboardInterrupt(f"{len(staged.finished)} of {len(shard_plan)} shards were finished and "
                                            f"are kept in {out}/.staging; continue with --resume") from None
            if sum(staged.counts) == 0:
                raise TfpipeError(f"every image was skipped; nothing written to {out}")
            skipped += staged.all_skipped()
            manifest = staged.commit(_manifest(split, labeled, single_label, names, source, spec, folds, seed, staged,
                                           skipped),
                                     overwrite=overwrite or resume)
    finally:
        shutdown(batches)  # no orphan workers after an error or Ctrl-C
    _summary(manifest, out, time.perf_counter() - started)
    return manifest


def _write_records(batches, staged, items, shard_of, last_of_shard, skip_bad, bar):
    """Appends encoded records to their shards in input order, marking each shard finished after its last record."""
    with bar:
        for batch in batches:
            for i, record, error in batch:
                if error is not None:
                    if not skip_bad:
                        raise TfpipeError(error)
                    staged.skip(shard_of[i], {"image": items[i].name, "reason": error})
                else:
                    staged.write(shard_of[i], record)
                if i in last_of_shard:
                    staged.finish(last_of_shard[i])
            bar.update(len(batch))


def _beam_options(pipeline_args):
    from tfpipe.beam import pipeline_options

    return pipeline_options(pipeline_args)


def _write_with_beam(staged, items, item_targets, spec, shard_plan, skip_bad, options):
    """Runs the Beam pipeline into the staging folder, then applies the error policy as ``_write_records`` does."""
    from tfpipe.beam import encode_shards

    parts = {s["index"]: staged.staged_path(s["index"]) for s in shard_plan}
    results = encode_shards(parts, items, item_targets, spec, shard_plan, options)
    failed = sorted(f for _, fails in results.values() for f in fails)
    if failed and not skip_bad:
        raise TfpipeError(failed[0][2])  # the first bad image in input order, as the default runner reports
    for index, (count, fails) in sorted(results.items()):
        staged.add_finished(index, count, [{"image": name, "reason": error} for _, name, error in fails])


def _folds(item_targets, num_classes, k, seed):
    from tfpipe.folds import assign_folds

    if item_targets is None:
        raise TfpipeError("--folds needs labels; an unlabeled split cannot be stratified")
    return assign_folds(item_targets, num_classes, k, seed)


def _check_output(out, overwrite):
    if existing_shards(out) and not overwrite:
        raise TfpipeError(f"{out} already holds shards; pass --overwrite to replace them")


def _manifest(split, labeled, single_label, names, source, spec, folds, seed, staged, skipped):
    return {
        "tfpipe_version": __version__,
        "schema": schema.describe(),
        "split": split,
        "labeled": labeled,
        "id_column": source.image_col if source.csv or isinstance(source, TfdsSource) else "image",  # submissions
        "single_label": single_label,
        "classes": names,
        "num_classes": len(names),
        "num_examples": sum(staged.counts),
        "image": dataclasses.asdict(spec),
        "folds": folds,
        "seed": seed,
        "skipped": skipped,
    }


def _summary(manifest, out, seconds):
    n = manifest["num_examples"]
    size = sum(fs.size(f"{out}/{s['file']}") for s in manifest["shards"])
    print(f"wrote {n} images in {len(manifest['shards'])} shards, {size / 1e6:.1f} MB, "
          f"{seconds:.1f} s, {n / seconds:.0f} images/s -> {out}")
    if manifest["skipped"]:
        listed = ", ".join(s["image"] for s in manifest["skipped"][:MAX_LISTED_SKIPS])
        more = f" and {len(manifest['skipped']) - MAX_LISTED_SKIPS} more" if len(
            manifest["skipped"]) > MAX_LISTED_SKIPS else ""
        print(f"skipped {len(manifest['skipped'])} images: {listed}{more} (reasons in {out}/{MANIFEST})")


def build_parser():
    p = argparse.ArgumentParser(prog="python -m tfpipe.write", description=__doc__.split("\n\n")[0])
    src = p.add_argument_group("source")
    src.add_argument("--csv", help="Kaggle-style CSV; without it --images is a folder per class")
    src.add_argument("--images", help="folder holding the images")
    src.add_argument("--image-col", default="image", help="CSV column with the file name or id (default: image)")
    src.add_argument("--labels-col", default="labels", help="CSV column with a separated label list (default: labels)")
    src.add_argument("--sep", default=" ", help="separator of --labels-col (default: space)")
    src.add_argument("--label-cols", help="one-hot label columns, comma-separated (e.g. healthy,rust,scab)")
    src.add_argument("--class-col", help="CSV column with a single class per row (single-label data)")
    src.add_argument("--classes", help="class names in index order, comma-separated (default: sorted labels)")
    src.add_argument("--split", default="train", help="shard name prefix; 'test' writes unlabeled records")
    src.add_argument("--tfds", metavar="NAME", help="read a TensorFlow Datasets dataset instead (e.g. cifar10)")
    src.add_argument("--tfds-split", default="train", help="TFDS split, e.g. train or 'train[:90%%]' (default: train)")
    src.add_argument("--data-dir", help="TFDS data directory (default: TFDS's own)")
    img = p.add_argument_group("images")
    img.add_argument("--image-size", type=int, help="resize to S x S (default: keep size, copy JPEGs as they are)")
    img.add_argument("--fit", choices=FITS, default="stretch",
                     help="non-square images: stretch (default, nothing cut off), crop (centre) or pad")
    img.add_argument("--format", choices=FORMATS, default="jpeg", help="stored encoding (default: jpeg)")
    img.add_argument("--quality", type=int, default=95, help="JPEG quality (default: 95)")
    img.add_argument("--max-pixels", type=float, default=100.0,
                     help="refuse source images above this many megapixels (default: 100)")
    out = p.add_argument_group("output")
    out.add_argument("--out", required=True, help="output folder (local or gs://)")
    out.add_argument("--shards", type=int, help="number of shards (default: multiple of 8, ~150 MB each)")
    out.add_argument("--folds", type=int, help="assign K stratified folds; shards never mix folds")
    out.add_argument("--seed", type=int, default=0, help="seed of the fold assignment (default: 0)")
    out.add_argument("--skip-bad", action="store_true", help="skip unreadable/missing images and list them")
    out.add_argument("--overwrite", action="store_true", help="replace shards already in --out")
    out.add_argument("--resume", action="store_true",
                     help="continue an interrupted write into --out (same command): keep its finished shards")
    run = p.add_argument_group("run")
    run.add_argument("--workers", type=int,
                     help="DataLoader workers (default: CPU count; 0 = in-process, the default for JPEG pass-through)")
    run.add_argument("--start-method", choices=("auto", "spawn", "forkserver", "fork"), default="auto",
                     help="how workers start (default: auto = fork unless TensorFlow is already loaded)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--runner", choices=RUNNERS, default="local",
                     help="local (default: a torch DataLoader here) or beam (Apache Beam; Beam's own pipeline "
                          "options go after --, e.g. -- --runner=DataflowRunner --project=P ...)")
    return p


def _csv_list(value):
    return tuple(v.strip() for v in value.split(",") if v.strip()) if value else ()


def run(args, pipeline_args=()):
    """Turns parsed arguments (and Beam options, given after ``--``) into a ``write_shards`` call."""
    if pipeline_args and args.runner != "beam":
        raise TfpipeError(f"options after -- ({' '.join(pipeline_args)}) are Beam pipeline options; "
                          "they need --runner beam")
    if args.image_size is not None and args.image_size < 1:
        raise TfpipeError(f"--image-size must be positive (got {args.image_size})")
    if not 1 <= args.quality <= 100:
        raise TfpipeError(f"--quality must be in 1..100 (got {args.quality})")
    if args.label_cols and args.class_col:
        raise TfpipeError("--label-cols and --class-col are two label layouts; give one")
    label_format = LabelFormat(labels_col=args.labels_col, sep=args.sep, label_cols=_csv_list(args.label_cols),
                               class_col=args.class_col)
    if args.tfds:
        source = TfdsSource(args.tfds, split=args.tfds_split, data_dir=args.data_dir, labeled=args.split != "test")
    elif not args.images:
        raise TfpipeError("give --images (a folder, with --csv or a folder per class) or --tfds NAME")
    else:
        source = Source(images=args.images, csv=args.csv, image_col=args.image_col, label_format=label_format,
                        labeled=args.split != "test")
    spec = ImageSpec(size=args.image_size, fit=args.fit, format=args.format, quality=args.quality,
                     max_pixels=int(args.max_pixels * 1e6))
    classes = list(_csv_list(args.classes)) or (list(label_format.label_cols) or None)
    write_shards(args.out, source, spec=spec, classes=classes, split=args.split, shards=args.shards,
                 folds=args.folds, seed=args.seed, skip_bad=args.skip_bad, overwrite=args.overwrite, resume=args.resume,
                 num_workers=args.workers, start_method=args.start_method, progress=not args.no_progress,
                 runner=args.runner, pipeline_args=pipeline_args)


def main(argv=None):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # after "--": Beam's options (it has its own --runner)
    return run_cli("tfpipe.write", run, build_parser().parse_args(argv[:cut]), argv[cut + 1:])


if __name__ == "__main__":
    sys.exit(main())
