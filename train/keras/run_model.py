"""A run's model, loaded and checked against its run: the model file is there (``model.keras``, or
``model-swa.keras`` with ``swa``), it is a Keras archive built for the run's classes and input, and it loads with
tfpipe's own layers and metrics. ``train.predict`` and a notebook load a run through here."""

from __future__ import annotations

import tempfile
import zipfile
from typing import Any

from tfpipe.runtime import fs
from tfpipe.runtime.errors import TfpipeError, option
from train.backends import keras_module
from train.runs import run as run_files
from train.runs.run import RunConfig

KERAS_CONFIG, KERAS_WEIGHTS = "config.json", "model.weights.h5"  # the members of a .keras archive (Keras 2.13+)


def load_run(run: str, config: RunConfig | None = None, swa: bool = False) -> tuple[Any, RunConfig]:
    """(model, run config) of a ``train.fit`` run folder -- its final model, or with ``swa`` its SWA average; the
    model must output the run's classes."""
    config = config or RunConfig.load(run)
    check_model_present(run, swa)
    name = run_files.model_files(swa)[0]
    run_files.check_file(run, name, f"put the run's own {name} back, or train the run again")
    model_path = run_files.path(run, name)
    model = load_model(model_path)
    check_model_fits_run(model, config, model_path)
    return model, config


def check_model_present(run: str, swa: bool) -> None:
    """The model asked for is in the run folder, else one line saying why it is not."""
    name = run_files.model_files(swa)[0]
    if fs.exists(run_files.path(run, name)):
        return
    recipe = RunConfig.load(run).recipe  # read first: a recipe's run has no Keras model at all
    if recipe:
        raise TfpipeError(
            f"{run} is a run of the PyTorch recipe {recipe} (model.pt): train.predict predicts train.fit's runs; "
            f"predict it with python examples/{recipe}.py --predict-only --run {run} --predict RECORDS"
        )
    config = RunConfig.load(run)
    finished = run_files.read_state(run).get("finished", False)
    if swa and finished and config.settings.get("swa_epochs"):
        raise TfpipeError(
            f"{run}: no {name}, though the run was trained with {option('swa_epochs', config.settings['swa_epochs'])}; "
            f"it was removed or not copied with the run (predict with its model.keras: {option('swa', False)})"
        )
    if swa and finished:
        raise TfpipeError(
            f"{run}: no {name}; the run was trained without {option('swa_epochs')} (predict with its model.keras)"
        )
    raise TfpipeError(f"{run}: no {name}; the run did not finish (continue it with train.fit --resume)")


def check_model_fits_run(model: Any, config: RunConfig, model_path: str) -> None:
    """The model must be the run's: its class count, input size and head (softmax for single-label runs,
    sigmoid for multi-label ones) as ``config.json`` says; a model file copied from another run is refused."""
    outputs, size = model.output_shape[-1], tuple(model.input_shape[1:3])
    activation = getattr(getattr(model.layers[-1], "activation", None), "__name__", None)
    expected = "softmax" if config.single_label else "sigmoid"
    if outputs != len(config.classes):
        problem = f"outputs {outputs} class{'es' * (outputs != 1)}, but {run_files.CONFIG} lists {len(config.classes)}"
    elif size != (config.image_size, config.image_size) and None not in size:
        problem = f"takes {size[0]}x{size[1]} px, but {run_files.CONFIG} says {config.image_size}"
    elif activation in ("softmax", "sigmoid") and activation != expected:
        problem = (
            f"ends in {activation}, but the run is {'single' if config.single_label else 'multi'}-label ({expected})"
        )
    else:
        return
    raise TfpipeError(f"{model_path} {problem}; the model file belongs to another run")


def _archive(f: Any, path: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(f)
    except zipfile.BadZipFile:
        raise TfpipeError(f"{path}: not a Keras model file (a .keras file is a zip archive); it is damaged") from None


def load_model(path: str) -> Any:
    """A ``.keras`` model file (uncompiled), also from ``gs://``.

    Keras reads the weights in place inside the zip archive, where every backward seek of h5py re-reads the
    archive member from its start: an EfficientNet-B0 takes tens of seconds to load, longer under 8 replicas
    (silence before prediction). Here the archive is read once, front to back: its config builds the model, and
    its weights file, extracted to a temporary folder, is loaded as a plain file (several times faster, the same
    weights bit for bit). An archive without those two members is refused in one line (Keras' own loader raises a
    ValueError with a traceback)."""
    from train.keras.models import custom_objects

    with fs.open(path, "rb") as f, _archive(f, path) as archive:
        missing = sorted({KERAS_CONFIG, KERAS_WEIGHTS} - set(archive.namelist()))
        if missing:  # every .keras file tf-keras 2.18+ saves holds both
            raise TfpipeError(f"{path}: a zip archive without {' and '.join(missing)}; not a model train.fit saved")
        config = archive.read(KERAS_CONFIG)
        fs.parse_json(config, path, f"its {KERAS_CONFIG}")  # as strictly as every JSON file read back
        with tempfile.TemporaryDirectory(prefix="tfpipe-model-") as folder:
            try:
                keras = keras_module()
                model = keras.models.model_from_json(config.decode("utf-8"), custom_objects=custom_objects())
            except (ValueError, TypeError, KeyError, AttributeError) as e:  # fields of the wrong kind or missing
                raise TfpipeError(
                    f"{path}: its {KERAS_CONFIG} does not describe a model Keras can build ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:200] if str(e) else 'no detail'}); the model file is damaged"
                ) from None
            model.load_weights(archive.extract(KERAS_WEIGHTS, folder))
    return model
