"""The one place that reads a finished run's predictions and decides: exact scores (``evaluation``),
thresholds tuned on the predictions they serve and which model a folder submits with (``tuning``), and what
every run writes of its validation predictions (``validation``). Keras, the PyTorch recipes, predict, CV, blend
and inspect all call it."""
