"""The folders a job leaves behind: a run folder (``run``: its file names, ``RunConfig``), a CV folder
(``cv_folder``: ``CVResult``), both read back and checked (``run_info``, for ``train.inspect``), and what
``fit()`` returns (``results``: ``FitResult``, whose serialisation is ``metrics.json``)."""
