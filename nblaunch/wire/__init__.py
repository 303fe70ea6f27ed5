"""What travels between the kernel, the nodes' agents and the ranks: events
and control messages (``channel``), the authenticated link to agents
(``link``), jobs and results (``payload``) and the notebook's own modules
(``modules``)."""
