"""The run's lifecycle: its folder, its state, progress, and preemption."""
