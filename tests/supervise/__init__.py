"""Tests of elasticd.supervise, mirroring the package."""
