"""Memory of a process as /proc tells it, for bench/token_cache.py (its own module, so that the
new process that bench/token_cache.py starts to time a second run can import it alone)."""
from __future__ import annotations

from pathlib import Path


def smaps(pid: int, cache: Path | str) -> dict:
    """rss, pss, uss and anon (anonymous: the process's own data, no file page) of the process and
    rss, pss of the cache's mapped files, in bytes. A file page only this process maps counts in
    its uss (Private_Clean): a lone rank's cache pages are in its uss, shared ones are not."""
    facts = {"rss": 0, "pss": 0, "uss": 0, "anon": 0, "cache_rss": 0, "cache_pss": 0}
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            key, _, rest = line.partition(":")
            kb = int(rest.split()[0]) * 1024 if rest.strip().endswith("kB") else 0
            if key == "Rss":
                facts["rss"] = kb
            elif key == "Pss":
                facts["pss"] = kb
            elif key == "Anonymous":
                facts["anon"] = kb
            elif key in ("Private_Clean", "Private_Dirty"):
                facts["uss"] += kb
    in_cache = False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                in_cache = len(fields) >= 6 and fields[5].startswith(str(cache))
            elif in_cache and fields[0] in ("Rss:", "Pss:"):
                facts["cache_" + fields[0][:-1].lower()] += int(fields[1]) * 1024
    return facts
