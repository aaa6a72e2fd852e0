"""Benchmarks of one engine in this process: speed against Hugging Face transformers
(``speed``), the cost of a tiny model's decode step by GEMM library (``step_cost``) and
decode with mixed context lengths (``decode_mixed``)."""
