"""The REST control plane of elasticd: a thin FastAPI app over the daemon's service object."""
