"""Where a generation goes and how it gets there: the policies and the plans they return,
the dispatcher that streams a generation from a node, and the fan-out of a request's
choices."""
