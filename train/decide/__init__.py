"""The one place that reads a finished run's predictions and decides: exact scores (``evaluation``), which model
a run or CV predicts with and whether its thresholds files are those it was scored at (``choice``), thresholds
tuned on the predictions they serve (``tuning``), and what every run writes of its validation predictions
(``validation``). Keras, the PyTorch recipes, predict, CV, blend
and inspect all call it."""
