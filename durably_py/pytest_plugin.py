"""pytest plugin (filled in by the testing module)."""
