"""The ladder: its stages' results and gates, its plan, what ends an attempt, and its records."""
