"""Where images and labels come from: a Kaggle-style CSV, a folder per class, TensorFlow Datasets; how labels are
spelled; folds. No TensorFlow at import (``TfdsSource`` imports it when used)."""
