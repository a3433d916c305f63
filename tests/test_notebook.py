"""The Kaggle TPU notebook runs headless, top to bottom, on tiny demo settings (8 virtual CPU replicas here)."""

import os

import nbformat
import pandas as pd
import pytest
from nbclient import NotebookClient

from tfpipe.runtime.console import NOISE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "examples", "kaggle_tpu.ipynb")
TINY = """MAKE_DEMO = True
DATA = "data"
RECORDS = "records"
RUN = "run"
IMAGE_SIZE = 32
DEMO_TRAIN, DEMO_TEST = 80, 12
MODEL = "small-cnn"
WEIGHTS = "none"
EPOCHS = 1
BATCH_SIZE = 2
STEPS_PER_EXECUTION = 2
WORKERS = 0
CV_RUN = "cv"
FOLDS = [0, 1]
BACKEND = "auto"
"""


def test_notebook_is_clean_and_thin():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code)  # outputs not committed
    assert sum(c.cell_type == "markdown" for c in nb.cells) >= len(code) - 1  # prose between the steps
    assert not any("def " in c.source or "class " in c.source for c in code)  # nothing that is not in the library


@pytest.mark.slow
def test_notebook_runs_end_to_end(tmp_path, monkeypatch):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1
    params[0].source = TINY
    monkeypatch.setenv("PYTHONPATH", ROOT)  # the kernel imports tfpipe and train from this checkout
    monkeypatch.delenv("TFPIPE_VERBOSE", raising=False)
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)  # what a notebook kernel has: TensorFlow logs at INFO
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "cpu: 8 replicas (MirroredStrategy)" in outputs and "validation AUC" in outputs and "exact-match" in outputs
    # No C++ log lines in any cell (TFPIPE_VERBOSE unset): fit and predict hold them back while they run.
    noise = [line for line in outputs.splitlines() if NOISE.match(line.encode()) or "rendezvous" in line]
    assert noise == [], noise[:5]
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 4  # contact sheet, curves, ROC, prediction grid
    submission = pd.read_csv(tmp_path / "submission.csv", keep_default_na=False)
    assert len(submission) == 12 and submission["image"].is_unique
    assert "train.cv: OOF of model.keras, 1 view" in outputs and "OOF AUC" in outputs  # cell 8: two folds
    ensemble = pd.read_csv(tmp_path / "submission-cv.csv", keep_default_na=False)
    assert list(ensemble["image"]) == list(submission["image"])
