"""Workloads for the evaluation (issue #21): chat sessions shaped like ShareGPT's, turns
timed by how fast people read and type, sessions arriving like BurstGPT's."""
