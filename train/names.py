"""The names the command lines offer, without TensorFlow: ``--help`` answers without starting it.

The tables behind them (``train.models.MODELS``, ``train.schedules``, ``train.strategy``) are checked against
these names by the tests.
"""

STRATEGIES = ("auto", "tpu", "gpu", "cpu")
SCHEDULES = ("cosine", "onecycle", "kaggle", "constant")
OPTIMIZERS = ("adam", "adamw", "sgd")
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
MODEL_NAMES = (
    "small-cnn",
    *(f"efficientnet-b{i}" for i in range(8)),
    *(f"efficientnetv2-{v}" for v in ("s", "m", "l", "b0", "b1", "b2", "b3")),
)
TTA_VIEW_COUNT = 8  # train.inference.TTA_VIEWS
