"""Pure DataFrame -> DataFrame transforms: no paths, no global session."""
