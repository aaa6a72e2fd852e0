"""Overture's benchmarks, grouped by subject: ``engine`` (one engine in this process),
``kvstore`` (the tiers and the resume path), ``cluster`` (real multi-process clusters),
``multimodel`` (several models on a node), ``eval`` (the Symphony-style evaluation), with
the evaluation's ``workloads`` and the cluster simulator ``sim``. ``harness`` starts the
clusters they and the tests run against. Each bench runs as ``python -m bench.<subject>.<name>``
and says in its docstring what it measures and how to reproduce it."""
