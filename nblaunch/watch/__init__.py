"""The call watches: one call on a rank pool from its start to its verdict
(``call``: a launch's; ``live``: live ranks'; ``launch``: a long run's steps
and preemption), the rules they ask each tick (``rules``), the stop button
(``stop_button``), the ranks' debuggers (``debug_desk``), the kernel's side
of preemption (``preempt``), a launch's restarts (``restarts``) and the
rank's frames rebuilt for ``%debug`` (``postmortem``)."""
