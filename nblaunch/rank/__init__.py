"""What runs inside a rank: the serve loop and its calls (``worker``), becoming
a rank (``setup``, and ``env`` for the kernel's environment recreated), dying
with the kernel (``lifeline``, and the ``janitor`` that outlives the rank),
interrupting a live call (``interrupts``), sending back results and failures
(``results``), the rank's namespace for live calls, and its stacks and frames
as the kernel reads them."""
