"""Training: strategies, the model table, LR schedules, ``python -m train.fit`` and ``python -m train.predict``.

Keras here is tf-keras 2.x (``import tf_keras``), not Keras 3: with TF 2.21 and Keras 3, ``model.fit`` under a
MirroredStrategy with ``steps_per_execution > 1`` fails (keras-team/keras#19246). tf-keras must be the release of
the installed TensorFlow; ``tfpipe.deps.require_keras`` checks that and says what to install. Importing ``train``
changes nothing in the process (no environment variables; the commands quiet TensorFlow in their ``main()``).
"""
