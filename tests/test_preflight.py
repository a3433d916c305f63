"""``train.fit --preflight``: a step compiled with XLA as a TPU compiles it, on the real shards; what a TPU would
refuse is named (the layer, the input, the setting), the memory of a core measured and the batch that fits.

Tiny models at 16 px in the default group (a compile takes a second or two); the whole preflight of small-cnn
and EfficientNet-B0 and the memory figures (several compiles each) in the slow group. The figure for
EfficientNet-B0 at 224 px is a benchmark (docs/project/benchmarks.md), not a timed test.
"""

from __future__ import annotations

import os

import pytest
import tensorflow as tf

import tfpipe
from tests.conftest import BACKEND, backend_keras
from train.accel.tpus import TPUS, Tpu
from train.fit import FitConfig, fit, main
from train.keras.compiling import compile_model
from train.keras.models import build_model, register_model
from train.keras.plan import ModelPlan, OptimizerPlan
from train.preflight import check as preflight_lib
from train.preflight.xla_step import buffer_bytes, compile_step

keras = backend_keras()  # tf-keras, or Keras 3 on JAX (TFPIPE_TEST_BACKEND)


@pytest.fixture(autouse=True)
def op_determinism_off():
    """TensorFlow's op determinism as a fresh process has it (off): a deterministic training test earlier in this
    worker turned it on for good, and XLA then refuses MaxPool's gradient -- what a user's process would see too,
    tested below on its own."""
    from tensorflow.python.framework import config as tf_config

    was = tf_config.is_op_determinism_enabled()
    tf_config.disable_op_determinism()
    yield
    if was:
        tf_config.enable_op_determinism()


def config(shard_dir, tmp_path, **kw):
    """A preflight of the test shards on one core: 40 images hold no 8-core batch."""
    settings = {"model": "small-cnn", "image_size": 32, "batch_size": 8, "replicas": 1, "verbose": 0}
    return FitConfig(records=shard_dir[0], run=str(tmp_path / "run"), preflight=True, **settings | kw)


@pytest.mark.slow
@pytest.mark.backends
def test_small_cnn_passes_and_nothing_is_written_or_changed(shard_dir, tmp_path, capsys):
    before = keras.mixed_precision.global_policy().name
    report = fit(config(shard_dir, tmp_path, verbose=2))
    out = capsys.readouterr().out
    assert report.ok and report.refuse == () and report.warn == ()
    memory = report.memory
    assert memory["measured"] > memory["weights"] + memory["optimizer"] + memory["batch"] > 0
    assert memory["largest_batch"] % 8 == 0 and memory["largest_batch"] > 8
    assert report.seconds["compile_training"] > 0 and report.seconds["compile_evaluation"] > 0
    assert BACKEND == "jax" or report.seconds["training_step"] > 0  # JAX's: compiled, not run
    assert "preflight: all clear for a TPU v3" in out and "(measured: XLA's buffers, on its CPU backend)" in out
    assert not os.path.exists(tmp_path / "run")  # the run folder is not touched
    assert keras.mixed_precision.global_policy().name == before  # bfloat16 was the preflight's, not the process's


def bad_builder(kind):
    """A backbone with one layer a TPU cannot run, named ``culprit``."""

    def build(variant, input_shape, weights):
        inputs = keras.Input(input_shape)
        x = keras.layers.Conv2D(8, 3, padding="same", name="conv")(inputs)
        if kind == "py_function":
            x = keras.layers.Lambda(
                lambda t: tf.ensure_shape(tf.py_function(lambda a: a * 2, [t], t.dtype), t.shape), name="culprit"
            )(x)
        elif kind == "string op":
            x = keras.layers.Lambda(
                lambda t: t + tf.cast(tf.strings.to_number(tf.strings.as_string(t)), t.dtype), name="culprit"
            )(x)
        elif kind == "float64":
            x = keras.layers.Dense(8, dtype="float64", name="culprit")(x)
        elif kind == "float64 cast":
            x = keras.layers.Lambda(lambda t: tf.cast(tf.cast(t, tf.float64) * 2.0, t.dtype), name="culprit")(x)
        elif kind == "dynamic shape":
            x = keras.layers.Lambda(lambda t: t + tf.reduce_sum(tf.boolean_mask(t, t > 0)), name="culprit")(x)
        return keras.Model(inputs, x, name="bad_backbone"), []

    return build


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("py_function", "layer test-bad/bad_backbone/culprit: op EagerPyFunc cannot be compiled by XLA; Python code"),
        (
            "string op",
            "layer test-bad/bad_backbone/culprit: op AsString cannot be compiled by XLA; a TPU has no strings",
        ),
        pytest.param(
            "float64",
            "layer test-bad/bad_backbone/culprit: float64 weights (a TPU has no float64)",
            marks=pytest.mark.slow,
        ),  # 8-9 s each: the two float64 kinds in make test-slow (issue #64)
        pytest.param("float64 cast", "layer test-bad/bad_backbone/culprit: float64 tensor [", marks=pytest.mark.slow),
    ],
)
def test_a_layer_a_tpu_cannot_run_is_refused_by_name(shard_dir, tmp_path, registry, capsys, kind, says):
    register_model("test-bad", min_image_size=8)(bad_builder(kind))
    argv = ["--records", shard_dir[0], "--run", str(tmp_path / "run"), "--model", "test-bad", "--image-size", "16"]
    code = main([*argv, "--batch-size", "8", "--replicas", "1", "--preflight", "--verbose", "2"])
    out = "".join(capsys.readouterr())
    refused = [line for line in out.splitlines() if line.startswith("preflight: REFUSED: ")]
    assert code == 2, out
    assert len(refused) == 1 and refused[0].startswith(f"preflight: REFUSED: {says}"), out  # one line, its layer
    assert "a TPU v3 would refuse this run: 1 REFUSED line above" in out and not os.path.exists(tmp_path / "run")


@pytest.mark.slow  # 14 s (issue #64: make test back toward its 6 minutes)
def test_a_shape_known_only_at_run_time_is_warned_naming_the_layer_and_the_report_prints_when_quiet(
    shard_dir, tmp_path, registry, capsys
):
    register_model("test-bad", min_image_size=8)(bad_builder("dynamic shape"))
    argv = ["--records", shard_dir[0], "--run", str(tmp_path / "run"), "--model", "test-bad", "--image-size", "16"]
    code = main([*argv, "--batch-size", "8", "--replicas", "1", "--preflight", "--verbose", "0"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "preflight: warning: layer test-bad/bad_backbone/culprit: a shape known only at run time (at most [" in out
    assert "preflight: all clear for a TPU v3" in out and "compiling" not in out  # quiet: the report, no progress


def test_a_batch_dimension_that_is_not_static_is_refused_naming_it(shard_dir):
    partial = tfpipe.make_dataset(shard_dir[0], 3)  # 40 images in 3s: the last batch holds 1
    (finding,) = preflight_lib.input_findings(partial.element_spec, "validation batches")
    assert finding.level == "refuse" and finding.culprit == "validation batches, images uint8[None, 32, 32, 3]"
    assert "the batch dimension is not static" in finding.why and "pad_batches=True" in finding.fix
    padded = tfpipe.make_dataset(shard_dir[0], 3, pad_batches=True)
    assert preflight_lib.input_findings(padded.element_spec, "validation batches") == []
    uneven = tfpipe.make_dataset(shard_dir[0], 3, training=True).map(
        lambda x, y: (x[:, : tf.random.uniform([], 1, 32, tf.int32)], y)  # a crop of random height
    )
    (finding,) = preflight_lib.input_findings(uneven.element_spec, "training batches")
    assert "a dimension is not static" in finding.why and "images uint8[3, None, 32, 3]" in finding.culprit


@pytest.mark.parametrize("dtype", [tf.int64, tf.uint64])
def test_every_64_bit_integer_type_is_warned_in_the_input_and_in_the_step(dtype):
    """A TPU emulates 64-bit integers, signed or not (uint64 passed as all clear before issue #53)."""
    from train.preflight.xla_step import compile_step, dtype_and_shape_findings

    spec = (tf.TensorSpec([4, 8, 8, 3], tf.uint8), tf.TensorSpec([4, 2], dtype))
    (finding,) = preflight_lib.input_findings(spec, "training batches")
    assert (finding.level, finding.why) == ("warn", "64-bit input") and dtype.name in finding.culprit
    step = compile_step(lambda x: tf.cast(tf.cast(x * 100, dtype) + tf.constant(3, dtype), tf.float32), tf.ones([4, 3]))
    found = dtype_and_shape_findings(step.lowered)  # one a layer (here: an op of no layer each)
    assert found and all(f.level == "warn" and f.why.startswith(f"{dtype.name} tensor [4,3]") for f in found)


def step_bytes(batch_size, image_size):
    """(all, not growing with the batch) bytes of small-cnn's compiled training step."""
    model, _ = build_model("small-cnn", 5, image_size)
    compile_model(model, ModelPlan("small-cnn", 5, image_size, False), OptimizerPlan(), 1e-3, 1)
    images = tf.zeros([batch_size, image_size, image_size, 3], tf.uint8)
    total, parameters = buffer_bytes(compile_step(model.train_step, (images, tf.zeros([batch_size, 5]))).proto)
    batch = images.shape.num_elements() + batch_size * 5 * 4
    return total, parameters - batch + sum(w.shape.num_elements() * 4 for w in model.trainable_weights)


@pytest.mark.slow
def test_the_memory_of_a_step_grows_with_the_batch_and_the_image_as_activations_do():
    total, fixed = step_bytes(8, 32)
    bigger_batch, fixed_b = step_bytes(16, 32)
    bigger_image, fixed_i = step_bytes(8, 64)
    assert fixed == fixed_b == fixed_i  # the weights, slots and gradients do not depend on the input
    grows = total - fixed
    assert 1.6 < (bigger_batch - fixed) / grows < 2.4  # twice the images
    assert 3.0 < (bigger_image - fixed) / grows < 5.0  # four times the pixels


@pytest.mark.slow
def test_a_step_too_big_for_a_core_is_refused_and_the_suggested_batch_fits(shard_dir, tmp_path, monkeypatch):
    first = fit(config(shard_dir, tmp_path, batch_size=8))
    assert first.ok, first.refuse
    measured = first.memory["measured"]
    small = Tpu("tiny", 1, int(measured * 0.6 / preflight_lib.HEADROOM), "a test's TPU")
    monkeypatch.setitem(TPUS, "tiny", small)
    refused = fit(config(shard_dir, tmp_path, batch_size=8, tpu="tiny"))
    (line,) = refused.refuse
    largest = refused.memory["largest_batch"]
    assert not refused.ok and line.startswith("memory of a core: the training step needs")
    assert 1 <= largest < 8 and f"use batch_size={largest} or less (measured)" in line
    assert refused.memory["largest_batch_is"] == "measured"
    fits = fit(config(shard_dir, tmp_path, batch_size=largest, tpu="tiny"))
    assert fits.ok and fits.memory["measured"] <= small.memory * preflight_lib.HEADROOM


@pytest.mark.slow  # 13 s
@pytest.mark.backends
def test_an_odd_batch_and_narrow_dense_layers_are_warned_not_refused(shard_dir, tmp_path, registry):
    def narrow(variant, input_shape, weights):
        inputs = keras.Input(input_shape)
        x = keras.layers.GlobalAveragePooling2D()(keras.layers.Conv2D(100, 3, name="conv")(inputs))
        outputs = keras.layers.Dense(96, name="narrow")(x)[:, None, None, :]
        return keras.Model(inputs, outputs, name="narrow_backbone"), []

    register_model("test-narrow", min_image_size=8)(narrow)
    settings = {"model": "test-narrow", "batch_size": 6, "strategy": "cpu", "precision": "mixed_float16"}
    report = fit(config(shard_dir, tmp_path, **settings))
    assert report.ok, report.refuse
    assert "batch_size=6: not a multiple of 8: a TPU core computes it as 8 (the rest is padding); use batch_size=8" in (
        report.warn
    )  # not 0: the suggestion is a batch the 30 training images hold
    warned = "\n".join(report.warn)
    assert "\nstrategy='cpu': the preflight checks the run for a TPU v3" in warned, warned
    assert "\nprecision='mixed_float16': float16 is the GPUs'" in warned
    assert "\nlayer test-narrow/narrow_backbone/narrow: 100 inputs and 96 units, not multiples of 128" in warned
    assert "\nlayer test-narrow/classifier: 96 inputs, not" in warned  # its outputs are the classes: not counted


@pytest.mark.slow
def test_op_determinism_on_in_the_process_is_named_with_its_fix(shard_dir, tmp_path):
    warned = fit(config(shard_dir, tmp_path, deterministic=True, seed=0))
    assert any(line.startswith("deterministic=True: not applied by the preflight") for line in warned.warn)
    keras.utils.set_random_seed(0)  # what train.fit --deterministic does before switching determinism on
    tf.config.experimental.enable_op_determinism()
    report = fit(config(shard_dir, tmp_path))
    (line,) = report.refuse
    assert line.startswith("layer small-cnn/small_cnn/pool") and "deterministic" in line, line
    assert line.endswith("leave --deterministic out of a TPU run")


def test_what_cannot_be_checked_here_is_one_line(shard_dir, tmp_path):
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        with pytest.raises(tfpipe.TfpipeError, match="call it outside strategy.scope()"):
            fit(config(shard_dir, tmp_path))
    with pytest.raises(tfpipe.TfpipeError, match=r"batch_size=8 at image_size=30000: 21.60 GB a batch"):
        fit(config(shard_dir, tmp_path, image_size=30000))  # not an out-of-memory traceback, nor a machine's swap


@pytest.mark.slow
def test_the_largest_batch_does_not_depend_on_the_batch_measured(shard_dir, tmp_path, registry):
    def heavy(variant, input_shape, weights):  # weights outweigh activations: 2 x 1024 x 1024 floats
        inputs = keras.Input(input_shape)
        x = keras.layers.GlobalAveragePooling2D()(keras.layers.Conv2D(128, 3, name="conv")(inputs))
        x = keras.layers.Dense(1024, name="wide")(keras.layers.Dense(1024, name="wider")(x))
        return keras.Model(inputs, x[:, None, None, :]), []

    register_model("test-heavy", min_image_size=8)(heavy)
    small, large = (fit(config(shard_dir, tmp_path, model="test-heavy", batch_size=b)).memory for b in (4, 24))
    assert small["largest_batch_is"] == large["largest_batch_is"] == "estimated"
    # an estimate (XLA shares buffers differently at other sizes), but not of the batch measured: 27x apart when
    # what does not grow with the batch was guessed rather than measured at a second size
    assert 0.8 < small["largest_batch"] / large["largest_batch"] < 1.25, (small, large)


def test_an_unknown_tpu_is_one_line(shard_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--records", shard_dir[0], "--preflight", "--tpu", "v9"])
    assert "invalid choice: 'v9'" in capsys.readouterr().err
    with pytest.raises(tfpipe.TfpipeError, match="unknown tpu 'v9': use one of v2, v3, v4, v5e"):
        fit(config(shard_dir, tmp_path, tpu="v9"))


@pytest.mark.slow
@pytest.mark.serial  # XLA compiles EfficientNet-B0 on every core: 115 s alone, 392-515 s beside CI's other tests
def test_efficientnet_b0_passes_the_preflight(shard_dir, tmp_path):
    report = fit(config(shard_dir, tmp_path, model="efficientnet-b0", image_size=64))
    assert report.ok, report.refuse
    assert report.memory["largest_batch"] >= 64
    assert len(report.warn) == 1 and "images stored at 32 px, each upscaled to 64 px" in report.warn[0], report.warn


def test_shards_stored_smaller_than_the_input_are_a_warning_that_they_are_upscaled(shard_dir, tmp_path, registry):
    """32 px shards checked at 48 px: the preflight said nothing of the upscaling a TPU would pay for (train.fit's
    build line says it: the same words); a smaller input (downscaling) or the stored size says nothing."""
    from train.keras.planning import upscaling

    def tiny(variant, input_shape, weights):  # a compile of a second or two
        inputs = keras.Input(input_shape)
        return keras.Model(inputs, keras.layers.Conv2D(128, 3, strides=4, name="conv")(inputs), name="tiny"), []

    register_model("test-tiny", min_image_size=8)(tiny)
    report = fit(config(shard_dir, tmp_path, model="test-tiny", image_size=48))
    assert report.ok and report.warn == (
        "image_size=48: images stored at 32 px, each upscaled to 48 px as read: no detail gained, 2.25x the pixels; "
        "write the shards at 48 px (tfpipe.write --image-size 48), or train at image_size=32",
    )
    assert upscaling(32, 32) is None and upscaling(32, 16) is None and upscaling(None, 48) is None
