"""The Symphony-style evaluation (issue #21): profiles, cluster variants, the load sampler
and the report that ``bench.eval.run`` puts together."""
