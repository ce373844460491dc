"""Command-line tools that sit beside the rlsys package."""
