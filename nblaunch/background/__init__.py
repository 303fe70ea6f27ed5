"""Background runs: ``submit`` (``submit``), a run in this kernel
(``in_kernel``: the ``Run`` handle and this kernel's runs), a detached run
and its supervisor (``detached``, ``supervisor``), and the run folder both
read and write (``folder``)."""
