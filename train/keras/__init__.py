"""The Keras trainer: ``FitConfig`` (``config``), the plan checked before the run folder is touched (``plan``),
the model table (``models``), compile settings (``compiling``), schedules, callbacks, SWA, the datasets a run
trains on (``data``), the run folder as ``train.fit`` writes it (``fit_run``), what a run writes after training
(``outputs``, ``report``, ``plots``), a run's model loaded back (``run_model``) and the engine that runs the
phases (``trainer``). Keras here is the backend's (``train.backends.keras_module``): tf-keras 2.x matched to
TensorFlow, or Keras 3 on JAX."""
