"""``python -m vsnap``: the CLI, for hosts where the console script is not installed."""

from vsnap.cli import main

main()
