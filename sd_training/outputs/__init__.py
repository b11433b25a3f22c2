"""What a run gives back: exports, model cards, metrics, trackers, the report's inputs."""
