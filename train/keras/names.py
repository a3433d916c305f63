"""The names the command lines offer, without TensorFlow: ``--help`` answers without starting it.

The tables behind them (``train.keras.schedules``, ``train.accel.strategy``) are checked against these names by the
tests. Model names need no copy here: ``train.keras.models`` registers its builders without starting TensorFlow.
"""

BACKENDS = ("auto", "tf", "jax")  # --backend (train.backends.choice)
STRATEGIES = ("auto", "tpu", "gpu", "cpu", "multiworker")
ONE_MACHINE = STRATEGIES[:4]  # train.predict's: predicting runs on one machine
SCHEDULES = ("cosine", "onecycle", "kaggle", "constant")
OPTIMIZERS = ("adam", "adamw", "sgd")
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
TTA_VIEW_COUNT = 8  # train.prediction.inference.TTA_VIEWS
CLASS_WEIGHTS = ("balanced",)  # --class-weight (None: every image weighs 1)
# --class-weight's and --sampling's help, train.fit's and the PyTorch recipes'
# (--sampling's names: tfpipe.format.sampling)
CLASS_WEIGHT_HELP = "balanced: weigh each class's loss by n / (classes x its training images), as scikit-learn does"
SAMPLING_HELP = "balanced: single-label batches drawn evenly over the classes"
