"""The accelerators: which distribution strategy a run uses (``strategy``), a multi-worker cluster
(``cluster``), and the TPUs a preflight checks for (``tpus``, without TensorFlow)."""
