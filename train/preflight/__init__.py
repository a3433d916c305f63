"""``--preflight``: a run's model, input and compiled steps checked for a TPU before TPU time is spent
(``check``), a step compiled with XLA and what its program shows (``xla_step``), and the memory of a core
(``core_memory``)."""

from train.preflight.check import preflight as preflight
