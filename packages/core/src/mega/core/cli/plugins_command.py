"""``mega plugins``: what is installed and what each plugin registered."""

from __future__ import annotations

import json

from mega.core.cli.argparser import CommandParser
from mega.core.plugins import get_plugins
from mega.core.plugins.failures import failure_line


def main(argv: list[str]) -> int:
    if argv[:1] == ["list"]:  # `mega plugins list`, as other tools spell listing, is `mega plugins`
        argv = argv[1:]
    parser = CommandParser(
        prog="mega plugins",
        description="List installed plugins, their distribution and version, and what they registered "
                    "(`mega plugins list` says the same). `mega plugins new NAME --kind KIND` (mega-train) writes "
                    "a new plugin distribution to start from.",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list for machines")
    parser.add_argument("--traceback", action="store_true",
                        help="print the full traceback of each plugin that failed to load (as MEGA_PLUGIN_TRACEBACKS=1)")
    args = parser.parse_args(argv)

    plugins = get_plugins()
    if args.json:
        print(json.dumps([info.as_json() for info in plugins.infos], indent=2))
        return 0

    contested = {(registry.kind, name) for registry in plugins.registries.values() for name in registry.contested()}
    rows = [("plugin", "distribution", "version", "registered")]
    for info in plugins.infos:
        registered = "; ".join(
            f"{kind}: " + ", ".join(f"{name} (CONTESTED)" if (kind, name) in contested else name for name in names)
            for kind, names in info.registered.items())
        if info.duplicates:
            registered += " | DUPLICATE " + "; ".join(info.duplicates)
        if info.error:
            registered = f"ERROR {info.error}" + (f" | {registered}" if registered else "")
        rows.append((info.name, info.distribution, info.version, registered or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=False)) + "  " + row[3])
    _print_kernel_backends(plugins)
    if plugins.disabled:
        print(f"\ndisabled by MEGA_LOAD_PLUGINS / MEGA_DISABLE_PLUGINS: {', '.join(plugins.disabled)}")
    for info in plugins.failed():
        print(f"\n{failure_line(info, with_traceback=args.traceback or None)}")
    return 0


def _print_kernel_backends(plugins) -> None:
    """Each kernel backend (the kinds it fills) and optimizer, and whether it is usable on this
    machine (what is missing when not): what ``--kernels NAME`` / ``--optimizer NAME`` would say."""
    rows = [("kernel backend or optimizer", "kinds", "usable here")]
    listed = [(name, plugins.kernel_backends) for name in plugins.kernel_backends.names()]
    listed += [(name, plugins.optimizers) for name in plugins.optimizers.names()]
    for name, registry in listed:
        try:
            obj = registry.get(name)
            kinds = ", ".join(sorted(getattr(obj, "kinds", ()))) if registry is plugins.kernel_backends else "(optimizer)"
            usable, missing = getattr(obj, "is_available", lambda: (True, ""))()
            status = "yes" if usable else f"no: {missing}"
        except Exception as error:  # a broken backend must not hide the others
            kinds, status = "?", f"ERROR {error}"
        rows.append((name, kinds, status))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    print()
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row[:2], widths, strict=False)) + "  " + row[2])
