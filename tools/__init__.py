"""Development tools run by the Makefile (not part of any service)."""
