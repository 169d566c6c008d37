"""Tests of elasticd.workers, mirroring the package."""
