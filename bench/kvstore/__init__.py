"""Benchmarks of the kvstore: each tier's throughput against its raw medium (``tiers``)
and time to first token when a conversation resumes from each tier (``resume_ttft``)."""
