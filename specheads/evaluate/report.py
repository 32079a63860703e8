"""Acceptance reports: report.json (machine-readable), report.md (tables) and PNG plots.

The report is written from one plain dict so that every engine (ours, vLLM)
and every comparison mode lands in the same shape:

    {"title", "created", "target", "prompts", "settings",
     "baseline": {"name", "tokens_per_s", ...},
     "runs": [{"name", "engine", "drafter", "k", "tree", "rule", "temperature",
               "metrics": <runtime.metrics.summarize()>, "per_category": {cat: tau},
               "tokens_per_s", "speedup", "lossless": {...}}, ...],
     "sweep": <evaluate.sweep.run_sweep()>  (with --sweep only)}
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

from specheads.fileio import disk_full_guard, publish_dir


def _fmt(x, nd=2) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        if math.isnan(x):
            return "—"
        return f"{x:.{nd}f}"
    return str(x)


def _lossless_cell(ll: dict | None) -> str:
    if not ll:
        return "—"
    if ll.get("kind") == "greedy":
        return f"{ll['identical']}/{ll['total']} identical"
    if ll.get("kind") == "chi_square":
        verdict = "pass" if ll.get("passed") else "FAIL"
        return f"χ² p_min={ll.get('p_min', float('nan')):.3g} ({verdict})"
    return ll.get("summary", "—")


def render_markdown(report: dict) -> str:
    runs = report.get("runs", [])
    lines = [f"# {report.get('title', 'Acceptance report')}", ""]
    t = report.get("target", {})
    p = report.get("prompts", {})
    s = report.get("settings", {})
    lines += [
        f"- target: `{t.get('name', '?')}` (config hash `{t.get('config_hash', '?')}`)",
        f"- prompts: {p.get('source', '?')} — {p.get('count', '?')} prompts, {p.get('turns', '?')} turns",
        f"- settings: max_new_tokens {s.get('max_new_tokens')}, batch {s.get('batch_size')}, "
        f"device {s.get('device')}, dtype {s.get('dtype')}, created {report.get('created', '?')}",
        "",
        "τ = tokens emitted per target decode forward (accepted drafts + 1), averaged over every decode "
        "forward, including forwards with no drafts. vLLM τ = 1 + accepted / drafts over forwards that "
        "carried drafts (vLLM's own figure). Speedup = tokens/s with drafting ÷ tokens/s without, same engine, "
        "prompts, max_new_tokens and sampling.",
        "",
        "| run | engine | drafter | k / tree | rule | T | τ | vLLM τ | acc. rate | tok/s | speedup | lossless |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    b = report.get("baseline")
    if b:
        lines.append(f"| {b.get('name', 'plain')} | {b.get('engine', 'specheads')} | none | — | — | "
                     f"{_fmt(b.get('temperature'))} | 1.00 | — | — | {_fmt(b.get('tokens_per_s'), 1)} | 1.00 | — |")
    for r in runs:
        m = r.get("metrics", {})
        kt = r.get("tree") or r.get("k")
        lines.append(
            f"| {r['name']} | {r.get('engine', 'specheads')} | {r.get('drafter')} | {kt} | {r.get('rule')} | "
            f"{_fmt(r.get('temperature'))} | {_fmt(m.get('tau'))} | {_fmt(m.get('vllm_mean_acceptance_length'))} | "
            f"{_fmt(m.get('acceptance_rate'))} | {_fmt(r.get('tokens_per_s'), 1)} | {_fmt(r.get('speedup'))} | "
            f"{_lossless_cell(r.get('lossless'))} |"
        )
    # per-position acceptance
    max_pos = max((len(r.get("metrics", {}).get("alpha", [])) for r in runs), default=0)
    if max_pos:
        lines += ["", "## Per-position acceptance α_i = P(draft i accepted | drafts 1..i−1 accepted)", "",
                  "| run | " + " | ".join(f"α_{i + 1}" for i in range(max_pos)) + " |",
                  "|---|" + "---|" * max_pos]
        for r in runs:
            a = r.get("metrics", {}).get("alpha", [])
            lines.append(f"| {r['name']} | " + " | ".join(_fmt(a[i]) if i < len(a) else "—" for i in range(max_pos)) + " |")
    cats = sorted({c for r in runs for c in (r.get("per_category") or {})})
    if cats:
        counts = (report.get("prompts") or {}).get("per_category") or {}
        heads = [f"{c} ({counts[c]})" if c in counts else c for c in cats]
        lines += ["", "## τ per prompt category (prompts in brackets)", "", "| run | " + " | ".join(heads) + " |",
                  "|---|" + "---|" * len(cats)]
        for r in runs:
            pc = r.get("per_category") or {}
            lines.append(f"| {r['name']} | " + " | ".join(_fmt(pc.get(c)) for c in cats) + " |")
    # lossless details
    details = [r for r in runs if r.get("lossless")]
    if details:
        lines += ["", "## Lossless checks", ""]
        for r in details:
            ll = r["lossless"]
            if ll.get("kind") == "greedy":
                lines.append(f"- **{r['name']}**: greedy output identical to plain decoding for "
                             f"{ll['identical']}/{ll['total']} sequences ({_fmt(100 * ll['identical'] / max(1, ll['total']), 1)}%).")
                for d in ll.get("divergences", [])[:10]:
                    lines.append(f"  - prompt `{d['prompt_id']}` turn {d.get('turn', 0)}: first divergence at generated "
                                 f"token {d['position']} (plain {d['plain_token']!r} vs drafted {d['drafted_token']!r}); "
                                 f"target logit margin top-1 − top-2 there: {_fmt(d.get('logit_margin'), 4)}")
            elif ll.get("kind") == "chi_square":
                lines.append(f"- **{r['name']}**: two-sample χ² of per-position token distributions, drafted vs plain, "
                             f"{ll.get('draws')} draws × {len(ll.get('p_values', []))} positions: p-values "
                             f"{', '.join(_fmt(x, 3) for x in ll.get('p_values', []))}; threshold "
                             f"{ll.get('alpha_level')} (Bonferroni): **{'pass' if ll.get('passed') else 'FAIL'}**"
                             + (f" — expected to fail: {ll['expect']}" if ll.get("expect") == "fail" else ""))
    if report.get("sweep"):
        lines += sweep_markdown(report["sweep"])
    extra = report.get("notes")
    if extra:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in extra]
    plots = report.get("plots", [])
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(pth).stem}]({Path(pth).name})" for pth in plots]
    return "\n".join(lines) + "\n"


PLAIN_NAME = "plain (no drafting)"     # the baseline's name in every report


def _serve_cells(sv: dict) -> tuple[str, str]:
    """(vLLM, SGLang) of a point's ``serving``, as a person pastes them."""
    vllm = f"`{sv['vllm_flag']}`" if sv.get("vllm_flag") else "no `--speculative-config`"
    if sv.get("sglang_flags"):
        return vllm, f"`{sv['sglang_flags']}`"
    return vllm, sv.get("sglang_note") or "no `--speculative-*` flags"


def _rate_cell(p: dict) -> str:
    """tok/s, with the slowest and fastest timed pass when there were several."""
    passes = p.get("tokens_per_s_passes") or []
    spread = f" ({passes[0]:.1f}–{passes[-1]:.1f})" if len(passes) > 1 else ""
    return f"{_fmt(p.get('tokens_per_s'), 1)}{spread}"


def sweep_markdown(sw: dict) -> list[str]:
    """The serving sweep: every point, then the configuration to serve with at each concurrency."""
    n = sw.get("repeat") or 1
    timing = (f"the median of {n} timed passes after an untimed one (slowest–fastest in brackets)" if n > 1
              else "one timed pass after an untimed one")
    lines = ["", "## Serving sweep (continuous batching)", "",
             f"{sw.get('conversations')} conversations ({sw.get('turns')} turns) served with continuous batching at "
             f"concurrency {', '.join(str(c) for c in sw.get('concurrency', []))} (requests in flight), greedy, "
             f"max_new_tokens {sw.get('max_new_tokens')}. τ = decode tokens per target decode forward, request by "
             f"request; tok/s = every generated token over the wall time, prefills included, {timing}; speedup = "
             "tok/s ÷ plain decoding's at the same concurrency; lossless = greedy outputs identical to plain "
             "decoding's there.", "",
             "| concurrency | drafter | k | τ | tok/s | speedup | lossless |", "|---|---|---|---|---|---|---|"]
    for base in sw.get("plain", []):
        C = base["concurrency"]
        lines.append(f"| {C} | {PLAIN_NAME} | — | 1.00 | {_rate_cell(base)} | 1.00 | — |")
        for p in sw.get("points", []):
            if p["concurrency"] == C:
                lines.append(f"| {C} | {p['drafter']} | {p['k']} | {_fmt(p.get('tau'))} | "
                             f"{_rate_cell(p)} | {_fmt(p.get('speedup'))} | "
                             f"{_lossless_cell(p.get('lossless'))} |")
    recs = sw.get("recommendation", [])
    if recs:
        lines += ["", "### Recommended serving configuration", "",
                  "Per concurrency, the fastest configuration measured above (ties: the smaller k, plain first). "
                  f"`vllm serve {sw.get('target', 'TARGET')}` takes the vLLM flag; SGLang's "
                  "`python -m sglang.launch_server` takes its flags.", "",
                  "| concurrency | serve with | k | τ | speedup | vLLM | SGLang |", "|---|---|---|---|---|---|---|"]
        for r in recs:
            vllm, sglang = _serve_cells(r.get("serving") or {})
            lines.append(f"| {r['concurrency']} | {r['drafter']} | {r['k'] or '—'} | {_fmt(r.get('tau'))} | "
                         f"{_fmt(r.get('speedup'))}× | {vllm} | {sglang} |")
    if sw.get("notes"):
        lines += [""] + [f"- {n}" for n in sw["notes"]]
    return lines


def _sweep_plot(sw: dict, plt):
    """Speedup against k, one panel per concurrency, a line per drafter; the recommended point starred."""
    concs = sw.get("concurrency", [])
    fig, axes = plt.subplots(1, len(concs), figsize=(4.2 * len(concs), 3.6), squeeze=False, sharey=True)
    rec = {r["concurrency"]: r for r in sw.get("recommendation", [])}
    for ax, C in zip(axes[0], concs):
        pts = [p for p in sw.get("points", []) if p["concurrency"] == C]
        for name in dict.fromkeys(p["drafter"] for p in pts):
            mine = sorted((p for p in pts if p["drafter"] == name), key=lambda p: p["k"])
            ax.plot([p["k"] for p in mine], [p["speedup"] for p in mine], marker="o", label=name)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--", label=PLAIN_NAME)
        r = rec.get(C)
        if r and r.get("k"):
            ax.plot([r["k"]], [r["speedup"]], marker="*", ms=16, color="gold", mec="black", ls="none",
                    label=f"recommended: {r['drafter']} k={r['k']}")
        ax.set_xticks(sorted({p["k"] for p in pts}))
        ax.set_xlabel("k (drafts per step)")
        ax.set_title(f"concurrency {C}")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("speedup over plain decoding")
    fig.suptitle("Serving sweep: speedup against k (continuous batching)")
    return fig


def write_plots(report: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report.get("runs", [])
    if not runs:
        return []
    paths = []
    names = [r["name"] for r in runs]

    def save(fig, name: str) -> None:
        fig.tight_layout()
        p = out_dir / name
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(str(p))

    if (report.get("sweep") or {}).get("points"):
        save(_sweep_plot(report["sweep"], plt), "sweep_speedup.png")

    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(runs) + 2), 3.8))
    taus = [r.get("metrics", {}).get("tau", float("nan")) for r in runs]
    vt = [r.get("metrics", {}).get("vllm_mean_acceptance_length", float("nan")) for r in runs]
    x = range(len(runs))
    ax.bar([i - 0.2 for i in x], taus, width=0.4, label="τ (all decode forwards)")
    ax.bar([i + 0.2 for i in x], vt, width=0.4, label="vLLM τ (forwards with drafts)")
    ax.set_xticks(list(x), names, rotation=20, ha="right")
    ax.set_ylabel("tokens per target forward")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.legend(fontsize=8)
    ax.set_title("Acceptance length")
    save(fig, "acceptance_length.png")

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    plotted = 0
    for r in runs:
        a = r.get("metrics", {}).get("alpha", [])
        if a:
            ax.plot(range(1, len(a) + 1), a, marker="o", label=r["name"])
            plotted += 1
    max_pos = max((len(r.get("metrics", {}).get("alpha", [])) for r in runs), default=0)
    ax.set_xticks(range(1, max_pos + 1))
    ax.set_xlabel("draft position i")
    ax.set_ylabel(r"$\alpha_i$ = P(draft i accepted | 1..i−1 accepted)", fontsize=8)
    ax.set_ylim(0, 1.02)
    ax.set_title("Per-position acceptance")
    if plotted:
        ax.legend(fontsize=8)
    save(fig, "alpha_by_position.png")

    cats = sorted({c for r in runs for c in (r.get("per_category") or {})})
    if cats:
        fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(cats) * max(1, len(runs) / 2) + 2), 3.8))
        w = 0.8 / len(runs)
        for j, r in enumerate(runs):
            pc = r.get("per_category") or {}
            ax.bar([i + j * w - 0.4 + w / 2 for i in range(len(cats))], [pc.get(c, float("nan")) for c in cats],
                   width=w, label=r["name"])
        counts = (report.get("prompts") or {}).get("per_category") or {}
        ax.set_xticks(range(len(cats)), [f"{c}\n({counts[c]} prompts)" if c in counts else c for c in cats],
                      rotation=20, ha="right")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--", label="no drafting (τ = 1)")
        ax.set_ylabel("τ (tokens per target forward)")
        ax.set_title("τ per prompt category")
        ax.legend(fontsize=8)
        save(fig, "tau_by_category.png")

    b = report.get("baseline") or {}
    tps = [r.get("tokens_per_s") for r in runs]
    if b.get("tokens_per_s") and any(tps):
        fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(runs) + 2), 3.8))
        labels = [b.get("name", "plain")] + names
        vals = [b["tokens_per_s"]] + [v or 0 for v in tps]
        ax.bar(range(len(vals)), vals, color=["grey"] + ["C0"] * len(runs))
        ax.set_xticks(range(len(vals)), labels, rotation=20, ha="right")
        ax.set_ylabel("generated tokens / s")
        ax.set_title("Throughput with and without drafting")
        save(fig, "throughput.png")
    return paths


def json_safe(x):
    """``x`` with NaN and infinities as None (JSON has neither)."""
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


REPORT_FILES = ("report.json", "report.md")


def _report_entry(p: Path) -> bool:
    """A file of a report (replaced by the next one); anything else in the directory (``vllm/``) is carried over."""
    return p.name in REPORT_FILES or (p.suffix == ".png" and p.is_file())


def _staging(out: Path) -> Path:
    return out.parent / f".{out.name}.tmp-{os.getpid()}"


def _recover(out: Path) -> None:
    """What a killed write_report left beside ``out``: entries it had carried over into its temporary sibling go
    back into ``out``; the rest of the sibling is removed. Where the filesystem cannot swap directories in one
    step, a kill between :func:`publish_dir`'s two renames leaves no ``out``, the previous report aside
    (``.NAME.old-PID``) and the new one complete in its sibling: the new one is put in place (it holds the
    carried-over entries too), else the previous one comes back."""
    if not out.parent.is_dir():
        return
    olds = sorted(out.parent.glob(f".{out.name}.old-*"))
    if olds and not out.exists():
        done = [t for t in sorted(out.parent.glob(f".{out.name}.tmp-*"))
                if (t / "report.json").is_file() and (t / "report.md").is_file()]
        back = done[-1] if done else olds[-1]
        os.rename(back, out)
        print(f"eval: a report write was cut short while publishing {out}: "
              f"{'the new report' if done else 'the previous report'} is in place again", file=sys.stderr)
    for old in out.parent.glob(f".{out.name}.old-*"):
        shutil.rmtree(old, ignore_errors=True)
    for tmp in sorted(out.parent.glob(f".{out.name}.tmp-*")):
        if out.is_dir():
            for p in tmp.iterdir():
                if not _report_entry(p) and not (out / p.name).exists():
                    os.rename(p, out / p.name)
        shutil.rmtree(tmp, ignore_errors=True)


def write_report(report: dict, out_dir: str | Path) -> dict[str, str]:
    """report.json, report.md and the plots, written into a temporary sibling of ``out_dir`` and published
    whole (:func:`specheads.fileio.publish_dir`): ``out_dir`` holds the previous report or the new one, never a
    mix. Other entries of ``out_dir`` (``vllm/``: vLLM's work and target copy) are moved over (renames). A full
    disk is a ``DiskFullError`` naming the file; the temporary sibling goes and the previous report stays."""
    given = Path(out_dir)  # the paths the report records and returns, as the user gave them
    out = given.resolve()  # a symlinked eval.out: publish where it points, the link stays valid
    here = Path.cwd().resolve()
    if out == here or out in here.parents:  # the working directory itself cannot be swapped
        return _write_in_place(report, out, given)
    out.parent.mkdir(parents=True, exist_ok=True)
    _recover(out)
    tmp = _staging(out)
    shutil.rmtree(tmp, ignore_errors=True)
    had = (out / "report.json").is_file()
    moved: list[str] = []

    def undo() -> None:  # carried-over entries go back, the partial report goes
        for name in moved:
            if (tmp / name).exists() and not (out / name).exists():
                os.rename(tmp / name, out / name)
        shutil.rmtree(tmp, ignore_errors=True)

    kept = (f"the partial report was removed and the previous report in {out} is unchanged" if had
            else f"the partial report was removed; no report was written to {out}")
    report = dict(report)
    with disk_full_guard(out, staging=tmp, kept=kept, cleanup=undo):
        try:
            tmp.mkdir()
            report["plots"] = [str(given / Path(p).name) for p in write_plots(report, tmp)]
            _write_durable(tmp / "report.json", json.dumps(json_safe(report), indent=2, default=str))
            _write_durable(tmp / "report.md", render_markdown(report))
            if out.is_dir():
                for p in sorted(out.iterdir()):
                    if not _report_entry(p):
                        os.rename(p, tmp / p.name)
                        moved.append(p.name)
            publish_dir(tmp, out)
        except BaseException:
            undo()
            raise
    return {"json": str(given / "report.json"), "md": str(given / "report.md"), "plots": report["plots"]}


def _write_in_place(report: dict, out: Path, given: Path) -> dict[str, str]:
    """The report written file by file into ``out`` (the working directory or one above it, which cannot be
    swapped): each file replaced whole by a rename, ``report.json`` last, so a complete report.json means a
    complete report."""
    tmp = out / f".report.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    report = dict(report)
    kept = f"the partial report was removed; files of the previous report in {out} were kept"
    with disk_full_guard(out, staging=tmp, kept=kept, cleanup=lambda: shutil.rmtree(tmp, ignore_errors=True)):
        tmp.mkdir()
        report["plots"] = [str(given / Path(p).name) for p in write_plots(report, tmp)]
        _write_durable(tmp / "report.md", render_markdown(report))
        _write_durable(tmp / "report.json", json.dumps(json_safe(report), indent=2, default=str))
        for name in sorted(p.name for p in tmp.iterdir() if p.name != "report.json") + ["report.json"]:
            os.replace(tmp / name, out / name)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"json": str(given / "report.json"), "md": str(given / "report.md"), "plots": report["plots"]}


def _write_durable(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
