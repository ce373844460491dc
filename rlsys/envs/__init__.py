"""Environments of multi-turn rollouts: the interface, tool-call formats, the built-in tools."""
