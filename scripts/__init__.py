"""Developer scripts (not part of the installed package): asset builders such as make_tiny_target.py."""
