"""RULER-style evaluation: task generation, runners, reports."""
