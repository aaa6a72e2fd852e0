"""Benchmarks of a whole cluster of real processes: a session resumed on another node
(``resume``), with an advisory ahead of it (``advisory_ttft``), goodput past capacity
(``overload``), hostile clients against the scheduler (``hostile_clients``) and what an
idle cluster costs in CPU (``idle_cost``)."""
