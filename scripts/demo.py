"""`make demo`: the whole pipeline on the embedded default, stage by stage, with timings.

Each stage is the real CLI command a user would type, so the demo doubles as
the walkthrough in the README. Stages skip work that is already complete
(regeneration, dump and training resume), so a rerun is cheap.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

RECIPE = sys.argv[1] if len(sys.argv) > 1 else "recipes/smollm2_eagle3.yaml"
EXTRA = sys.argv[2:]
SPECHEADS = [sys.executable, "-m", "specheads.cli"]
# what the demo head is, and what a head trained on a GPU reaches (BENCHMARKS.md, the SmolLM2 reference run)
NOTE = ("\nNote: the demo head is trained for minutes on a CPU from a few hundred short answers, so on a CPU it is\n"
        "slower than plain decoding. The reference head, trained on one H100 (~21 min from prompts to an\n"
        "evaluated head), reaches τ 2.57 on the mixed eval set and 1.14× plain decoding there on the H100\n"
        "(see BENCHMARKS.md).")


def run(title: str, args: list[str]) -> float:
    cmd = SPECHEADS + args
    print(f"\n=== {title}\n$ specheads {' '.join(args)}", flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True)
    dt = time.time() - t0
    print(f"--- {title}: {dt:.0f} s", flush=True)
    return dt


def main() -> None:
    from specheads.config import load_recipe
    from specheads.rundir import RunDir

    recipe = load_recipe(RECIPE, EXTRA)
    times = {}
    t0 = time.time()
    if recipe.data.regenerate.enabled:
        times["regenerate"] = run("1/7 regenerate answers with the target", ["data", "regenerate", RECIPE, *EXTRA])
    times["prepare"] = run("2/7 token rows (chat template + loss mask)", ["data", "prepare", RECIPE, *EXTRA])
    times["vocab"] = run("3/7 draft vocabulary", ["vocab", RECIPE, *EXTRA])
    if recipe.dump.mode == "offline":
        times["dump"] = run("4/7 dump hidden states", ["dump", RECIPE, *EXTRA])
    # resume: a rerun continues (or finds finished) the demo's own run rather than refusing to start over it
    times["train"] = run("5/7 train the EAGLE-3 head", ["train", RECIPE, "train.resume=true", *EXTRA])
    times["export"] = run("6/7 export (speculators format) + validate", ["export", RECIPE, *EXTRA])
    times["eval"] = run("7/7 acceptance report vs n-gram", ["eval", RECIPE, *EXTRA])
    total = time.time() - t0
    print("\n=== demo finished in %.1f min" % (total / 60))
    for k, v in times.items():
        print(f"  {k:<11}{v:7.0f} s")
    report = RunDir(recipe).eval / "report.md"
    if report.exists():
        print(f"\n{report}:\n")
        print(report.read_text())
    print(NOTE)
    (Path(recipe.run_dir) / "demo_times.json").write_text(json.dumps({"total_s": total, **times}, indent=2))


if __name__ == "__main__":
    main()
