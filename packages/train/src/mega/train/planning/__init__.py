"""``mega plan``: memory per rank, FLOPs and step time of a run before it is launched."""
