"""Write a Kaggle-style image folder + CSV as sharded TFRecords.

    python -m tfpipe.write --csv data/demo/train.csv --images data/demo/images \
        --out records/demo/train --image-size 128 --num-folds 5

Steps: read the source (CSV or folder-per-class) -> fix the classes -> assign
folds -> plan shards -> decode/resize/encode/serialize in a torch DataLoader
-> write shards in input order under staging names -> rename them into place
and write ``manifest.json``. See ``python -m tfpipe.write --help``.

This module is the command: its flags, the one-line error edge and the exit codes, over
``tfpipe.writer.engine.write_shards`` (the engine; also ``tfpipe.write_shards``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tfpipe.runtime.errors import ArgumentParser, TfpipeError, check_path, run_cli
from tfpipe.sources.labels import LabelFormat
from tfpipe.sources.source import SourceProtocol
from tfpipe.writer.engine import open_source as open_source  # also importable as tfpipe.write.open_source
from tfpipe.writer.engine import write_shards as write_shards  # also importable as tfpipe.write.write_shards
from tfpipe.writer.images import FITS, FORMATS, ImageSpec, from_millions
from tfpipe.writer.runners import RUNNERS


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m tfpipe.write", description=(__doc__ or "").split("\n\n")[0])
    src = p.add_argument_group("source")
    src.add_argument("--csv", help="Kaggle-style CSV; without it --images is a folder per class")
    src.add_argument("--images", help="folder holding the images")
    src.add_argument("--image-col", default="image", help="CSV column with the file name or id (default: image)")
    src.add_argument("--labels-col", default="labels", help="CSV column with a separated label list (default: labels)")
    src.add_argument(
        "--sep", default=" ", help="separator of --labels-col (default: space); 'list' for cells like ['cat', 'dog']"
    )
    src.add_argument(
        "--spaces-in-names",
        action="store_true",
        help="class names contain spaces: with a --sep that is not whitespace (e.g. ','), a label such "
        "as 'golden retriever' is then read as one name (without it, it is refused: lists "
        "separated by spaces, read with --sep ,, look the same)",
    )
    src.add_argument("--label-cols", help="one-hot label columns, comma-separated (e.g. healthy,rust,scab)")
    src.add_argument("--class-col", help="CSV column with a single class per row (single-label data)")
    src.add_argument("--classes", help="class names in index order, comma-separated (default: sorted labels)")
    src.add_argument("--split", default="train", help="the split's name (train, test, ...): the shards' name prefix")
    src.add_argument(
        "--unlabeled",
        action="store_true",
        help="test images without labels: records carry no target, label columns are not read",
    )
    src.add_argument("--tfds", metavar="NAME", help="read a TensorFlow Datasets dataset instead (e.g. cifar10)")
    src.add_argument("--tfds-split", default="train", help="TFDS split, e.g. train or 'train[:90%%]' (default: train)")
    src.add_argument("--data-dir", help="TFDS data directory (default: TFDS's own)")
    _image_args(p)
    _output_args(p)
    _run_args(p)
    return p


def _image_args(p: argparse.ArgumentParser) -> None:
    img = p.add_argument_group("images")
    img.add_argument("--image-size", type=int, help="resize to S x S (default: keep size, copy JPEGs as they are)")
    img.add_argument(
        "--fit",
        choices=FITS,
        default="stretch",
        help="non-square images: stretch (default, nothing cut off), crop (centre) or pad",
    )
    img.add_argument("--format", choices=FORMATS, default="jpeg", help="stored encoding (default: jpeg)")
    img.add_argument("--quality", type=int, default=95, help="JPEG quality (default: 95)")
    img.add_argument(
        "--max-pixels",
        type=float,
        default=100.0,
        help="refuse source images whose header declares more megapixels, before the rest of the file "
        "is read (default: 100)",
    )
    img.add_argument(
        "--max-bytes",
        type=float,
        default=1000.0,
        help="refuse source files above this many megabytes, before they are opened; no more is ever "
        "read (default: 1000, which holds any 100 MP image)",
    )


def _output_args(p: argparse.ArgumentParser) -> None:
    out = p.add_argument_group("output")
    out.add_argument("--out", required=True, help="the shard folder to write (local or gs://)")
    out.add_argument("--num-shards", type=int, help="number of shards (default: multiple of 8, ~150 MB each)")
    out.add_argument("--num-folds", type=int, metavar="K", help="number of stratified folds; shards never mix folds")
    out.add_argument(
        "--group-col",
        metavar="NAME",
        help="CSV column of each image's group (patient, video, site): every image of a group in one fold",
    )
    out.add_argument("--seed", type=int, default=0, help="seed of the fold assignment (default: 0)")
    out.add_argument("--skip-bad", action="store_true", help="skip unreadable/missing images and list them")
    out.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the dataset tfpipe.write wrote in --out (only files its manifest lists)",
    )
    out.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted write into --out (same command): keep its finished shards",
    )


def _run_args(p: argparse.ArgumentParser) -> None:
    run = p.add_argument_group("run")
    run.add_argument(
        "--workers",
        type=int,
        help="DataLoader workers (default: CPU count; 0 = in-process, the default for JPEG pass-through)",
    )
    run.add_argument(
        "--start-method",
        choices=("auto", "spawn", "forkserver", "fork"),
        default="auto",
        help="how workers start (default: auto = fork unless TensorFlow is already loaded)",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument(
        "--runner",
        choices=tuple(RUNNERS),
        default="local",
        help="local (default: a torch DataLoader here) or beam (Apache Beam; Beam's own pipeline "
        "options go after --, e.g. -- --runner=DataflowRunner --project=P ...)",
    )


def _csv_list(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip()) if value else ()


def source_from_args(args: argparse.Namespace) -> SourceProtocol:
    """The source the flags name (``tfpipe.open_source``, as from Python)."""
    if args.label_cols and args.class_col:
        raise TfpipeError("--label-cols and --class-col are two label layouts; give one")
    label_format = LabelFormat(
        labels_col=args.labels_col,
        sep=args.sep,
        label_cols=_csv_list(args.label_cols),
        class_col=args.class_col,
        spaces_in_names=args.spaces_in_names,
    )
    return open_source(
        args.images,
        args.csv,
        tfds=args.tfds,
        tfds_split=args.tfds_split,
        data_dir=args.data_dir,
        image_col=args.image_col,
        label_format=label_format,
        labeled=not args.unlabeled,
        group_col=args.group_col,
    )


def run_command(args: argparse.Namespace, pipeline_args: Sequence[str] = ()) -> None:
    """Turns parsed arguments (and Beam options, given after ``--``) into a ``write_shards`` call."""
    check_path(csv=args.csv, images=args.images, data_dir=args.data_dir)
    if pipeline_args and args.runner != "beam":
        raise TfpipeError(
            f"options after -- ({' '.join(pipeline_args)}) are Beam pipeline options; they need --runner beam"
        )
    source = source_from_args(args)
    spec = ImageSpec(
        image_size=args.image_size,
        fit=args.fit,
        format=args.format,
        quality=args.quality,
        max_pixels=from_millions(args.max_pixels, "max_pixels"),
        max_bytes=from_millions(args.max_bytes, "max_bytes"),
    )  # checks every setting, before any work
    label_cols = list(source.label_format.label_cols) if source.label_format else []
    write_shards(
        source,
        args.out,
        spec=spec,
        classes=list(_csv_list(args.classes)) or label_cols or None,
        split=args.split,
        num_shards=args.num_shards,
        num_folds=args.num_folds,
        seed=args.seed,
        skip_bad=args.skip_bad,
        overwrite=args.overwrite,
        resume=args.resume,
        workers=args.workers,
        start_method=args.start_method,
        progress=not args.no_progress,
        runner=args.runner,
        pipeline_args=pipeline_args,
    )


def main(argv: Sequence[str] | None = None) -> int:

    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # after "--": Beam's options (it has its own --runner)
    return run_cli("tfpipe.write", run_command, build_parser().parse_args(argv[:cut]), argv[cut + 1 :])


if __name__ == "__main__":
    sys.exit(main())
