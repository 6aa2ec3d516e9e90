"""``mega doctor``: is this machine ready to train (versions, GPUs, topology, plugins, environment)?"""
