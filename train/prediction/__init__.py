"""Prediction: the engine of ``train.predict`` (``inference``), what it predicts with -- a run or a CV's fold
ensemble (``target``) --, its scores on labeled shards (``scores``), the submission CSV (``submission``) and the
competition's sample submission it follows (``sample``)."""
