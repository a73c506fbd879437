"""How a StageJob's processes start: its command line (command), its fan-out over nodes (nodes), and the
process tree that runs it (proc)."""
