"""The PyTorch recipes' support (``examples/torch_ddp.py``, ``examples/lightning_swa.py``): their model table
(``models``), run folder (``run``) and report (``report``), and their ranks' launchers (``ranks`` for spawned
and torchrun ranks, ``lightning_ranks`` for Lightning's own). The shards as a PyTorch dataset are
``tfpipe.torch.dataset``."""
