"""Predict test shards with a trained run and write a Kaggle submission CSV.

    python -m train.predict --run runs/demo --records records/demo/test --out submission.csv --tta 4

Rows follow the shards' written order and are keyed by the CSV id stored in each record. By default each
row holds the predicted labels, space-separated, at the per-class thresholds tuned on validation
(``thresholds.json`` of the run; ``--threshold`` overrides); ``--probabilities`` writes one column per class
instead (the Plant Pathology 2020 format), and with ``--labels`` both. ``--sample-submission FILE`` follows the
competition's file instead: its header, id column and id order, and its form (class columns: probabilities; one
column: the labels). ``--save-probabilities FILE`` also keeps the test probabilities for ``train.blend --test``
(a CV folder's each fold's too). On labeled shards it prints exact scores
too (AUC, exact-match accuracy, F1; the run's own training shards split into held-out and trained-on rows). This
module is the command line and imports no TensorFlow
(``--help`` answers at once); ``predict`` runs the engine in ``train.prediction.inference``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tfpipe.runtime.console import quiet_call
from tfpipe.runtime.errors import ArgumentParser, check_path, run_cli
from train.keras.config import PredictConfig as PredictConfig  # re-exported: train.predict.PredictConfig
from train.keras.names import BACKENDS, ONE_MACHINE, TTA_VIEW_COUNT
from train.prediction.sample import SAMPLE_HELP

if TYPE_CHECKING:
    import pandas as pd
    import tensorflow as tf

    from tfpipe.format.shards import Records


@quiet_call
def predict(
    run: str,
    records: Records,
    out: str | None = "submission.csv",
    *,
    tta: int = 1,
    threshold: float | None = None,
    probabilities: bool = False,
    labels: bool | None = None,
    strategy: str | tf.distribute.Strategy = "auto",
    replicas: int | None = None,
    backend: str = "auto",
    batch_size: int = 32,
    id_column: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    swa: bool | None = None,
    sample_submission: str | None = None,
    save_probabilities: str | None = None,
) -> pd.DataFrame:
    """Writes the submission of run folder ``run`` -- or of a CV folder (``train.cv``): the mean of its fold
    models' probabilities, labelled at thresholds tuned on its out-of-fold predictions -- on the shards ``records``
    (a shard folder, a glob, files, or ``Shards`` already opened) to ``out``; returns it as a DataFrame.

    The keyword arguments are the command line's flags: ``tta`` views to average, one ``threshold`` for every
    class (default: the run's tuned ones), ``probabilities`` (one column per class instead of the labels;
    ``labels=True`` keeps the labels column too), ``strategy`` (a name or a
    strategy you made) and ``replicas``, ``backend`` (tf or jax: the run's own; auto takes it),
    ``batch_size`` per replica, ``id_column``, ``overwrite``, ``progress``
    (a progress bar), ``swa`` (True: the run's SWA model, ``model-swa.keras``, with its own thresholds; False: its
    final model; None: the one with the better validation AUC, said in one line), ``sample_submission`` (the
    competition's ``sample_submission.csv``, local or ``gs://``: the submission takes its header, its id column
    and its ids in its order -- every predicted id once, no other -- and its form: class-name columns get the
    probabilities, one other column the labels under its name), ``save_probabilities`` (a CSV of the test
    probabilities too, the form ``train.blend --test`` reads; a CV's each fold's model's as well, ``-fold-K``
    before the extension). Without a sample the labels column is named as the training CSV's label column
    (``tfpipe.write --class-col label``: ``label``; else ``labels``). Thresholds are those tuned for
    the model and the ``tta`` views predicted (``train.decide.tuning``: tuned on the validation images predicted alike
    the first time a view count is asked for, and recorded in the run folder).

    Example::

        from train.predict import predict
        df = predict("runs/demo", "records/demo/test", "submission.csv", tta=2)
    """
    from train.accel.cluster import check_one_machine
    from train.backends import choice as backends

    check_one_machine(strategy)
    choice = backends.for_run(backend, backends.trained_backend(run), run)
    backends.use_backend(choice, strategy, replicas)  # before Keras starts: its backend, XLA's devices
    from train.prediction import inference  # the engine (Keras): imported when predicting, not with the command

    backend = choice.name
    options = {k: v for k, v in locals().items() if k in PARAMETERS}  # every parameter, by its field's name
    return inference.predict(PredictConfig(**options))


PARAMETERS = tuple(f.name for f in dataclasses.fields(PredictConfig))  # predict's parameters, the command's dests


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m train.predict", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--run", required=True, help="run folder written by train.fit, or a CV folder of train.cv")
    p.add_argument("--records", required=True, help="shards to predict (e.g. written with --split test)")
    add_output_flags(p)
    p.add_argument("--tta", type=int, default=1, help=f"test-time augmentation views to average (1..{TTA_VIEW_COUNT})")
    p.add_argument(
        "--threshold", type=float, help="multi-label: one threshold for every class (default: tuned per class)"
    )
    p.add_argument("--strategy", choices=ONE_MACHINE, default="auto", help="auto: TPU, then GPUs, then CPU")
    p.add_argument("--replicas", type=int, help="with --strategy cpu: N virtual CPU replicas")
    p.add_argument(
        "--backend", choices=BACKENDS, default="auto", help="tf or jax: the one the run trained with (auto: its own)"
    )
    p.add_argument("--batch-size", type=int, default=32, help="per replica")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar (shown by default)")
    p.add_argument(
        "--swa",
        action=argparse.BooleanOptionalAction,
        help="the run's SWA model (model-swa.keras, from --swa-epochs); --no-swa: its final model (default: the "
        "one with the better validation figure by the run's --metric, said)",
    )
    return p


def add_output_flags(p: ArgumentParser) -> None:
    """What is written: the submission (its file, its columns, the competition's sample followed) and the
    probabilities kept for a blend."""
    p.add_argument(
        "--out",
        default="submission.csv",
        help="CSV to write (replaces only a file train.predict wrote there and nobody changed since)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace --out (and --save-probabilities' files) whatever they hold"
    )
    p.add_argument(
        "--sample-submission",
        metavar="FILE",
        help=SAMPLE_HELP,
    )
    p.add_argument(
        "--save-probabilities",
        metavar="FILE",
        help="also write the test probabilities (id column, one column per class: train.blend --test's form); "
        "for a CV folder each fold's model's too, as FILE with -fold-K before the extension",
    )
    p.add_argument(
        "--probabilities", action="store_true", help="one probability column per class (instead of the labels)"
    )
    p.add_argument(
        "--labels", action="store_const", const=True, help="with --probabilities: the labels column too"
    )  # None when left out: predict's own default (labels unless --probabilities)
    p.add_argument("--id-column", help="name of the id column (default: the CSV's, from the manifest)")


def check_inputs(run: str, records: str) -> None:
    """The run folder and the shards, read before the engine starts TensorFlow: a mistyped ``--run`` or
    ``--records`` is answered before TensorFlow loads. The engine reads both again, with every other check."""
    from tfpipe.format.shards import open_shards  # here, not at the top: --help stays instant
    from train.runs.cv_folder import CVResult, is_cv_folder
    from train.runs.run import RunConfig

    check_path(run=run, records=records)
    CVResult.load(run) if is_cv_folder(run) else RunConfig.load(run)
    open_shards(records)


def run_command(args: argparse.Namespace) -> None:
    check_path(out=args.out, sample_submission=args.sample_submission, save_probabilities=args.save_probabilities)
    check_inputs(args.run, args.records)
    df = predict(**{name: getattr(args, name) for name in PARAMETERS})  # PredictConfig's fields, one flag each
    print(f"wrote {len(df)} row{'s' * (len(df) != 1)} ({args.tta} view{'s' if args.tta > 1 else ''}) -> {args.out}")


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("train.predict", run_command, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
