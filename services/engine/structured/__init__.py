"""Constrained decoding: grammars compiled by llguidance, one token mask per sequence."""

from .constraint import Constraint, GrammarCompiler

__all__ = ["Constraint", "GrammarCompiler"]
