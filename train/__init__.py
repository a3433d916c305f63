"""Training: strategies, the model table, LR schedules and ``python -m train.fit``.

Keras here is tf-keras 2.x (``import tf_keras``), not Keras 3: with TF 2.21 and
Keras 3, ``model.fit`` under a MirroredStrategy with ``steps_per_execution > 1``
fails (keras-team/keras#19246). ``TF_USE_LEGACY_KERAS=1`` makes ``tf.keras`` the
same tf-keras for code that goes through ``tf.keras``.
"""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
