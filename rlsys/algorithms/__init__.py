"""RL mathematics as pure tensor functions (see the README's algorithm table)."""
