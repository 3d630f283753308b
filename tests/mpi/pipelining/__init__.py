"""pipelining/: pipeline stages, schedules and model splits across ranks."""
