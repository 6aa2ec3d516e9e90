"""Mixture-of-experts layers: the router, the grouped experts, the token dispatchers, the layer."""
