"""What runs inside a rank: the serve loop and its calls (``worker``), becoming
a torchrun rank (``env``), the rank's namespace for live calls, its stacks
and frames as the kernel reads them, and the janitor that outlives it."""
