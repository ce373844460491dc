"""Checkpoint conversion: a thin entry point over ``rlsys.convert.cli``."""
