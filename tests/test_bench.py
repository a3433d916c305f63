"""The benchmarks still run (on a handful of images; the figures themselves mean nothing at this size)."""

import os
import subprocess
import sys

import pytest
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.bench
@pytest.mark.slow
def test_every_benchmark_runs_and_writes_results_and_chart(tmp_path):
    results = tmp_path / "results.md"
    r = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--work", str(tmp_path / "work"), "--results", str(results)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    text = results.read_text()
    for figure in (
        "writer / seed (marginal)",
        "writer / codec limit",
        "pass-through / seed q100",
        "reader / decode limit",
        "reader / seed parser",
        "training input / seed, epoch>=2",
        "fed by make_dataset / in memory",
        "writer RSS 4N / N",
        "service: trainer CPU per image / in process",
        "steps_per_execution 8 / 1",
        "steps_per_execution 32 / 1",
        "TPU dry run: 1 / 2 replicas, train.fit",  # the smoke run's dry run: 2 replicas, same code as 8
        "TPU dry run, Keras 3 on JAX: 1 / 2 devices, train.fit",  # the backends' smoke dry run: 2 devices too
        "CPUs",
        "tensorflow 2.21.0",
    ):
        assert figure in text, figure
    has_old = subprocess.run(["git", "-C", ROOT, "cat-file", "-e", "c092a63^{commit}"], capture_output=True)
    if has_old.returncode == 0:  # a clone with history: the reader of the commit before the checks, beside ours
        assert "| c092a63 |" in text and "| this checkout |" in text, text
    with Image.open(tmp_path / "results.png") as chart:
        chart.verify()
    # A full-size run never reuses the smoke run's corpus or figures (it once published a 16-photo writer run).
    r = subprocess.run(
        [sys.executable, "-m", "bench", "--only", "none", "--work", str(tmp_path / "work"), "--results", str(results)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert r.returncode == 2 and "other sizes" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert text == results.read_text()


@pytest.mark.bench
@pytest.mark.slow
def test_the_group_folds_benchmark_writes_both_rows_of_its_table(tmp_path):
    """The training guide's flattering-vs-honest table, on 12 photographs of 2 crops (figures meaningless)."""
    r = subprocess.run(
        [sys.executable, "-m", "bench.group_folds", str(tmp_path), "--photos", "12", "--copies", "2", "--epochs", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| by ")]
    assert [row.split(" |")[0] for row in rows] == ["| by image (`--num-folds 5`)", "| by group (`--group-col photo`)"]
    assert "no group in two" in r.stdout
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "train.csv").write_text("a user's")
    r = subprocess.run([sys.executable, "-m", "bench.group_folds", str(tmp_path / "other")], cwd=ROOT,
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))  # fmt: skip
    assert r.returncode == 2 and r.stderr.strip().endswith(
        "holds files this benchmark did not write; choose a new or empty folder"
    )
    assert (tmp_path / "other" / "train.csv").read_text() == "a user's"


def test_the_competition_bench_refuses_more_images_than_memory_holds_in_one_line(tmp_path):
    """``--images 100000000000`` ended in NumPy's _ArrayMemoryError traceback (745 GiB asked for) after the work
    folder was made: the images the bench holds at once are checked against this machine's memory first, one line
    naming --images and the most that fit, exit 2, nothing written."""
    work = tmp_path / "work"
    r = subprocess.run(
        [sys.executable, "-m", "bench.competition", str(work), "--images", "100000000000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    (line,) = r.stderr.splitlines()
    assert r.returncode == 2 and line.startswith("bench.competition: error: --images 100000000000: "), r.stderr
    assert "more than this machine's" in line and line.endswith(" or fewer") and not work.exists()
