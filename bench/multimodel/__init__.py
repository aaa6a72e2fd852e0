"""Benchmarks of several models served by one cluster (Prism): TTFT attainment under a
bursty trace against static partitioning and swapping (``load``), and model activation in
a running engine against starting one (``activation``)."""
