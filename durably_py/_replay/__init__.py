"""The kernel that runs one run's workflow code against its log: steps, replay, turns."""
