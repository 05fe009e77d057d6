"""`vsnap bench`: cold starts against restores on one clock, the outputs compared, the floor."""
