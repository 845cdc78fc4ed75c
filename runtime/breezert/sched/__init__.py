"""sched package."""
