"""Stand-ins for scripts/gpu_serving_check.py (see stand_in.py)."""
