"""Each failed job's one-line cause, for the end of Snakemake's output (the Snakefile's `onerror`), where
Snakemake's own blocks (the command, the log's dump, its traceback) bury it:

    wattgate: rule <name> failed: <the last line a wattgate command printed in its log> (log: <path>)

    python workflow/scripts/failed_jobs.py SNAKEMAKE_LOG...
"""

import re
import sys

BLOCK = re.compile(r"^Error in rule ", re.M)
LOG = re.compile(r"^\s+log: (.+?)(?: \(check log file\(s\) for error details\))?$", re.M)


def failed_jobs(text: str) -> list[tuple[str, str | None]]:
    """(rule, its first log file or None) for each rule with an "Error in rule" block, in order, once each."""
    out, seen = [], set()
    for block in BLOCK.split(text)[1:]:
        name = block.split(":", 1)[0].strip()
        if name in seen:
            continue
        seen.add(name)
        logged = LOG.search(block)
        out.append((name, logged.group(1).split(", ")[0] if logged else None))
    return out


def cause(log_path: str | None) -> str | None:
    """The last line a wattgate command printed (`wattgate <stage>: ...`), else the log's last line."""
    if log_path is None:
        return None
    try:
        lines = open(log_path, errors="replace").read().splitlines()
    except OSError:
        return None
    ours = [line for line in lines if line.startswith("wattgate ")]
    rest = [line for line in lines if line.strip()]
    return (ours or rest or [None])[-1]


def main(paths: list[str]) -> int:
    text = ""
    for path in paths:
        try:
            text += open(path, errors="replace").read()
        except OSError:
            pass
    for name, log_path in failed_jobs(text):
        where = f" (log: {log_path})" if log_path else ""
        print(f"wattgate: rule {name} failed: {cause(log_path) or 'see the output above'}{where}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
