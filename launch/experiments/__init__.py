"""Sharding-strategy experiments (run under ``python -m launch``)."""
