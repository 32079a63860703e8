"""Where do the duplicates of a synthesized prompt set come from? Per category and per opener.

    python benchmarks/synth_duplicates.py RUN/data/synthesized.jsonl [--seeds builtin:synthesize_seeds] [--out X.json]

Reads the kept prompts and the dropped ones (``synthesized.jsonl.dropped.jsonl`` beside them, with
their reasons), matches each prompt's first user turn to the longest opener of its category in the
seeds ({topic} matching any text), and prints, per category and opener, how many attempts there were
and how many were dropped as exact or near duplicates, worst first. Copy-heavy prompts (their
categories have no openers) are counted under their category alone.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specheads.config import SynthesizeConfig  # noqa: E402
from specheads.data.appendlog import read_rows  # noqa: E402
from specheads.data.synthesize import load_seeds  # noqa: E402

DUPLICATE = ("exact_duplicate", "near_duplicate")


def opener_patterns(openers: dict[str, list[str]]) -> dict[str, list[tuple[str, re.Pattern]]]:
    out = {}
    for cat, ops in openers.items():
        pats = [(o, re.compile(re.escape(o).replace(re.escape("{topic}"), ".+?"), re.S)) for o in ops if o]
        out[cat] = sorted(pats, key=lambda p: -len(p[0]))      # the longest opener that matches wins
    return out


def opener_of(patterns, category: str, text: str) -> str:
    for opener, pat in patterns.get(category, []):
        if pat.match(text):
            return opener
    return ""


def analyse(kept: list[dict], dropped: list[dict], openers: dict[str, list[str]]) -> dict:
    """``openers``: category -> its openers, as the seeds give them."""
    pats = opener_patterns(openers)
    attempts, dups = collections.Counter(), collections.Counter()
    for row, reason in [(r, None) for r in kept] + [(r, r.get("reason")) for r in dropped]:
        turns = row.get("turns") or [""]          # a prompt dropped before its first turn was written
        key = (row["category"], opener_of(pats, row["category"], turns[0]))
        attempts[key] += 1
        if reason in DUPLICATE:
            dups[key] += 1
    rows = [{"category": c, "opener": o, "attempts": n, "duplicates": dups[(c, o)],
             "duplicate_share": dups[(c, o)] / n} for (c, o), n in attempts.items()]
    rows.sort(key=lambda r: -r["duplicates"])
    total_dups = sum(dups.values())
    return {"kept": len(kept), "dropped": len(dropped), "duplicates": total_dups,
            "near_duplicate_rate": total_dups / max(1, len(kept) + total_dups), "by_opener": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("synthesized", help="the synthesized prompts (JSONL); the dropped file is read beside it")
    ap.add_argument("--seeds", default="builtin:synthesize_seeds", help="the seeds the set was written with")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    path = Path(a.synthesized)
    dropped_path = path.with_name(path.name + ".dropped.jsonl")
    if not dropped_path.is_file():
        raise SystemExit(f"{dropped_path}: not found (the dropped prompts are written beside the kept ones)")
    seeds = load_seeds(SynthesizeConfig(seeds=a.seeds))
    res = analyse(read_rows(path), read_rows(dropped_path), {c.name: c.openers for c in seeds.categories})
    print(f"{res['kept']} kept, {res['duplicates']} dropped as duplicates, "
          f"near-duplicate rate {100 * res['near_duplicate_rate']:.1f}%\n")
    print("| category | opener | attempts | duplicates | share |")
    print("|---|---|---:|---:|---:|")
    for r in res["by_opener"][:a.top]:
        print(f"| {r['category']} | {r['opener'] or '(none)'} | {r['attempts']} | {r['duplicates']} | "
              f"{100 * r['duplicate_share']:.0f}% |")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
