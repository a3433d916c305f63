"""The one place that reads a finished run's predictions and decides: the metric that decides (``metrics``),
exact scores (``evaluation``), which model a run or CV predicts with and whether its thresholds files are those it
was scored at (``choice``), thresholds tuned on the predictions they serve (``tuning``), whether TTA helps
(``tta``), a blend's searched weights (``weights``), and what every run writes of its validation predictions
(``validation``). Keras, the PyTorch recipes, predict, CV, blend and inspect all call it."""
