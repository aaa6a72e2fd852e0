"""The Symphony-style evaluation (issue #21): profiles, cluster variants, the load sampler
and the report that ``bench/run_eval.py`` puts together."""
