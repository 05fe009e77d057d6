"""The use cases, each reading as its phases: capture, restore, standby (activate), stop, gpus
(which GPU a restore takes), resources (what a capture or a restore needs of the host), tree (boot an engine tree: shared by capture and bench), validate and
bench/. Imports every room below it; the CLI imports these."""
