"""The scheduler's view of the cluster: the registered nodes and their load, where each
session's KV is, and the gRPC channels to the nodes."""
