"""A discrete-event simulator of an Overture cluster (see README.md)."""
