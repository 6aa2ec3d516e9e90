"""mega-muon: the Muon optimizer (``--optimizer muon``), registered through mega's plugin manager."""
