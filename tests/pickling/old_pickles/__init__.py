"""Frozen payloads made by an earlier cadence (see generate.py and test_old_pickles.py)."""
