"""Time the test tiers and write the table docs/testing.md quotes (between its test-times markers).

    python scripts/test_times.py                  # run `pytest -m quick` and `pytest`, then write both rows
    python scripts/test_times.py --tier quick     # only the quick tier's row (the other row is kept)
    python scripts/test_times.py --check          # the table is this script's: parse it, render it, compare

Each row: the tier, its command, the tests that passed, the wall time, and where it was measured (the date, the
commit, the machine's cores and its load when the run started). Run it on an idle machine: times at load say
little. The README and docs/testing.md quote no other test count or time (tests/test_prose.py checks it).
"""
import argparse
import datetime
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "testing.md")
BEGIN, END = "<!-- test-times: written by scripts/test_times.py -->", "<!-- /test-times -->"
TIERS = {"quick": ["pytest", "-m", "quick"], "all": ["pytest"]}
HEADER = ["| tier | command | passed | time | measured |", "|---|---|---|---|---|"]
ROW = re.compile(r"\| (\w+) \| `([^`]*)` \| (\d+|-) \| (\d+) min (\d+) s \| ([^|]+) \|")   # -: not recorded


def measure(tier: str) -> tuple:
    """(tier, command, passed, seconds, where) of one run of the tier from the repository root."""
    load, started = os.getloadavg()[0], time.monotonic()
    proc = subprocess.run([sys.executable, "-m", *TIERS[tier]], cwd=ROOT, capture_output=True, text=True)
    seconds = round(time.monotonic() - started)
    passed = re.findall(r"(\d+) passed", proc.stdout)   # the summary line is the last to say it
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    where = (f"{datetime.date.today()}, {commit.stdout.strip()}, {os.cpu_count()} cores at load {load:.1f}"
             + ("" if proc.returncode == 0 else f", exit status {proc.returncode}"))
    return tier, " ".join(TIERS[tier]), int(passed[-1]) if passed else None, seconds, where


def render(rows: list[tuple]) -> str:
    lines = [f"| {tier} | `{command}` | {'-' if passed is None else passed} | {seconds // 60} min {seconds % 60} s "
             f"| {where} |" for tier, command, passed, seconds, where in rows]
    return "\n".join([BEGIN, *HEADER, *lines, END])


def parse(text: str) -> list[tuple]:
    """The rows of the table in `text` (the page)."""
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    return [(m[1], m[2], None if m[3] == "-" else int(m[3]), int(m[4]) * 60 + int(m[5]), m[6].strip())
            for m in ROW.finditer(block)]


def current_block(text: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[start:end]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tier", choices=sorted(TIERS), help="time only this tier (default: both)")
    parser.add_argument("--check", action="store_true", help="check that the table is this script's, run nothing")
    args = parser.parse_args()
    with open(PAGE) as f:
        text = f.read()
    rows = parse(text)
    if args.check:
        ok = render(rows) == current_block(text) and [row[:2] for row in rows] == [
            (tier, " ".join(command)) for tier, command in TIERS.items()]
        print("the table is scripts/test_times.py's" if ok else f"{PAGE}: the table between the markers is not "
              "this script's: run python scripts/test_times.py")
        sys.exit(0 if ok else 1)
    fresh = {row[0]: row for row in rows}
    fresh.update({tier: measure(tier) for tier in ([args.tier] if args.tier else TIERS)})
    with open(PAGE, "w") as f:
        f.write(text.replace(current_block(text), render([fresh[tier] for tier in TIERS])))


if __name__ == "__main__":
    main()
