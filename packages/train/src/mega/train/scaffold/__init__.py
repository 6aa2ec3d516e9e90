"""``mega plugins new``: a plugin distribution to start from, written from the template files
shipped beside this module."""
