"""Checkpoint reading and the checked tables that map checkpoint keys to our modules."""
