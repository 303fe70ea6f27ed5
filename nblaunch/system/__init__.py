"""What nblaunch asks of the operating system: libc calls (``linux``), a
process's identity (``procid``), pidfds (``pidfds``), the route to a host
(``network``) and what each rank uses (``resources``). Imports nothing of
nblaunch's."""
