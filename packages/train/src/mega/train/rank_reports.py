"""The local launcher's side of the hang reports (see mega.train.hang_report): asking the
ranks still running for their reports after a collective timeout, and naming from them the rank
that is behind (the one that entered fewer collectives on the group where the others wait).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

# Set by the launcher for its ranks: the directory where each rank leaves rank_R.json (its
# report's data) and where the launcher's request for reports appears.
DEBUG_DIR_ENV = "MEGA_DEBUG_DIR"
REQUEST_FILE = "report-request"


def request_reports(directory: str, reason: str, ranks_running: list[int], wait_s: float = 5.0) -> None:
    """Ask every rank for its report and wait (at most ``wait_s``) for those still running."""
    request = Path(directory) / REQUEST_FILE
    request.write_text(reason)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if all((Path(directory) / f"rank_{rank}.json").exists() for rank in ranks_running):
            return
        time.sleep(0.05)


def name_the_rank_behind(directory: str) -> str | None:
    """The line naming the rank(s) behind on the group where a collective timed out, from the
    ranks' reports; None when they do not tell (no report, or no rank behind)."""
    reports = {}
    for path in Path(directory).glob("rank_*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        reports[data["rank"]] = data
    stuck = [data for data in reports.values() if data["waiting"]]
    if not stuck:
        return None
    waiting = max((data["waiting"] for data in stuck), key=lambda call: call["sequence"])
    group, ranks = waiting["group"], waiting["ranks"] or sorted(reports)
    entered = {rank: reports[rank]["sequences"].get(group, 0) for rank in ranks if rank in reports}
    behind = sorted(rank for rank, count in entered.items() if count < waiting["sequence"])
    silent = [rank for rank in ranks if rank not in reports]
    if not behind and not silent:
        return None
    parts = [f"rank {rank} is behind: it entered {entered[rank]} collectives on group {group} (ranks {ranks})"
             for rank in behind]
    parts += [f"rank {rank} sent no report" for rank in silent]
    where = {data["report"].rsplit("/", 1)[0] for data in reports.values() if data.get("report")}
    return ("; ".join(parts) + f", while others wait in #{waiting['sequence']} ({waiting['op']})"
            + (f"; reports in {', '.join(sorted(where))}" if where else ""))
