"""What mega-inference registers with mega, through the entry-point group ``mega``.

Contributions are added here as they land; the plugin is listed by ``mega plugins`` from the start.
"""
