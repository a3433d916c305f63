"""Cross-validation's engine (``engine``): every fold trained in turn into one CV folder, the out-of-fold
scores, the thresholds tuned on them."""
