"""The use cases, each reading as its phases: capture, restore, standby (activate), stop, gpus
(which GPU a restore takes), tree (boot an engine tree: shared by capture and bench), validate and
bench/. Imports every room below it; the CLI imports these."""
