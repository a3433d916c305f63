"""The Keras trainer: ``FitConfig`` (``config``), the plan checked before the run folder is touched (``plan``),
the model table (``models``), compile settings (``compiling``), schedules, callbacks, SWA, the run folder as
``train.fit`` writes it (``fit_run``), what a run writes after training (``outputs``, ``report``, ``plots``) and
the engine that runs the phases (``trainer``). Keras here is tf-keras 2.x, matched to TensorFlow."""
