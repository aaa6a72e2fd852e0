"""Advisories (Symphony §3.3, §3.6): the book of pending ones, where each goes (the
policy's advisory plan), the throttle of tenants that advise uselessly, and the advisor
that ties them to the nodes' prefetches."""
