"""Example dtensor programs (run each with ``python -m launch -n 4 launch/examples/<name>.py``)."""
