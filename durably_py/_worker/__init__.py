"""Workers: the durable queue, schedules and the loop that claims due runs."""
