"""Training: strategies, the model table, LR schedules, ``python -m train.fit`` and ``python -m train.predict``.

Two backends run the one trainer, each a module of ``train.backends`` (``train.backends.choice`` chooses): tf-keras
2.x (``import tf_keras``) on TensorFlow's strategies -- with Keras 3, ``model.fit`` under a MirroredStrategy with
``steps_per_execution > 1`` fails (keras-team/keras#19246); tf-keras must be the release of the installed
TensorFlow, which ``tfpipe.runtime.deps.require_keras`` checks -- and Keras 3 on JAX (``--backend jax``,
``keras.distribution.DataParallel``). Importing ``train`` changes nothing in the process (no environment variables;
the commands quiet TensorFlow in their ``main()``, and set ``KERAS_BACKEND`` only for ``--backend jax``).
"""
