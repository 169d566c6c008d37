"""Tests of the cluster store (elasticd.store)."""
