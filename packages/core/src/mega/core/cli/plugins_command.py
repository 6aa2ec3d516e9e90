"""``mega plugins``: what is installed and what each plugin registered."""

from __future__ import annotations

import json

from mega.core.cli.argparser import CommandParser
from mega.core.plugins import get_plugins


def main(argv: list[str]) -> int:
    parser = CommandParser(
        prog="mega plugins",
        description="List installed plugins, their distribution and version, and what they registered.",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list for machines")
    args = parser.parse_args(argv)

    plugins = get_plugins()
    if args.json:
        print(json.dumps([info.as_json() for info in plugins.infos], indent=2))
        return 0

    rows = [("plugin", "distribution", "version", "registered")]
    for info in plugins.infos:
        registered = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in info.registered.items())
        if info.error:
            registered = f"ERROR {info.error}" + (f" | {registered}" if registered else "")
        rows.append((info.name, info.distribution, info.version, registered or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=False)) + "  " + row[3])
    backends = kernel_backend_rows(plugins)
    if backends:
        print("\nkernel backends (--kernels NAME, --attention-backend NAME, ...):")
        width = max(len(name) for name, _ in backends)
        for name, state in backends:
            print(f"  {name.ljust(width)}  {state}")
    if plugins.disabled:
        print(f"\ndisabled by MEGA_LOAD_PLUGINS / MEGA_DISABLE_PLUGINS: {', '.join(plugins.disabled)}")
    return 0


def kernel_backend_rows(plugins) -> list[tuple[str, str]]:
    """(name, "usable: kinds" or "unusable: what is missing") for every registered kernel backend."""
    rows = []
    for name in plugins.kernel_backends.names():
        try:
            backend = plugins.kernel_backends.get(name)
            available, missing = backend.is_available()
        except Exception as error:  # a backend that fails to load is reported, not fatal
            rows.append((name, f"unusable: {type(error).__name__}: {error}"))
            continue
        kinds = ", ".join(sorted(getattr(backend, "kinds", ())))
        rows.append((name, f"usable: {kinds}" if available else f"unusable: {missing}"))
    return rows
