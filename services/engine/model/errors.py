"""Typed errors of the model package."""

from __future__ import annotations


class LoaderError(Exception):
    """A model folder cannot be used: the message names the file or tensor and the fix."""
