"""Benchmarks of agent workloads on a whole cluster: ReAct tool loops through the OpenAI
Agents SDK, unchanged, with and without the advisories the scheduler infers
(``tool_loop``)."""
