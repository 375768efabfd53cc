"""pytest plugin for regression experiments (registered through the ``pytest11`` entry point)."""
