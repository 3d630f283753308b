"""pipelining/: the schedules as data (action lists) and the model splits."""
