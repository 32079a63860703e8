"""The report of ``bench_runtime.py``: its table rows, Markdown tables and the plot of speedup against batch size."""
from __future__ import annotations

from pathlib import Path


def table_rows(eng, B, rows, after=None) -> list[dict]:
    """The table's rows of one engine and batch from its timed runs ``rows`` [(drafter, bench_engine result)],
    plain first; ``after``: plain timed again after the drafted rows (None: not re-timed)."""
    base = rows[0][1]
    out = []
    for name, r in rows:
        sp = r["tokens_per_s"] / base["tokens_per_s"]
        # the same prefill is in both runs' time; the decode speedup is the drafting's own
        dsp = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        row = {"engine": eng, "batch": B, "drafter": name, "plain_tokens_per_s": base["tokens_per_s"],
               "speedup": sp, "speedup_over_tau": sp / r["tau"],
               "decode_speedup": dsp, "decode_speedup_over_tau": dsp / r["tau"]}
        if after is not None:
            spa = r["tokens_per_s"] / after["tokens_per_s"]
            row.update({"plain_after_tokens_per_s": after["tokens_per_s"],
                        "plain_after_lossless": after["outputs"] == base["outputs"],
                        "speedup_vs_plain_after": spa, "speedup_vs_plain_after_over_tau": spa / r["tau"]})
        out.append({**row, **{k: v for k, v in r.items() if k != "outputs"}})
    return out


def markdown(res) -> str:
    lines = [f"### Decode speed, {res['target']}, {res['device']}, {res['dtype']}, graphs={res['cuda_graphs']}, "
             f"{res['new_tokens']} new tokens, greedy, k={res['k']}"
             + (", every row in a process of its own" if res.get("isolated") else ""), "",
             "| engine | batch | drafter | τ | tok/s | tok/s after prefill | plain tok/s | speedup | speedup ÷ τ | "
             "speedup after prefill ÷ τ | plain tok/s, re-timed after | speedup ÷ τ against it | tok/s ÷ eager plain |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    eager_plain = {r["batch"]: r["tokens_per_s"] for r in res["rows"]
                   if r["drafter"] == "plain" and r.get("engine", "eager") == res.get("engines", ["eager"])[0]}
    for r in res["rows"]:
        lines.append(f"| {r.get('engine', 'eager')} | {r['batch']} | {r['drafter']} | {r['tau']:.2f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['decode_tokens_per_s']:,.0f} | "
                     f"{r['plain_tokens_per_s']:,.0f} | {r['speedup']:.2f}× | "
                     f"{r['speedup_over_tau']:.2f} | {r['decode_speedup_over_tau']:.2f} | "
                     f"{r.get('plain_after_tokens_per_s', r['plain_tokens_per_s']):,.0f} | "
                     f"{r.get('speedup_vs_plain_after_over_tau', r['speedup_over_tau']):.2f} | "
                     f"{r['tokens_per_s'] / eager_plain[r['batch']]:.2f}× |")
    timed = [r for r in res["rows"] if r.get("step_times")]
    if timed:
        lines += ["", "GPU time per decode step by attention width (CUDA events, one more run; idle = the device's "
                  "gap before a step):", "", "| engine | batch | drafter | width | steps | GPU ms/step | idle ms |",
                  "|---|---:|---|---:|---:|---:|---:|"]
        for r in timed:
            for kv, t in r["step_times"].items():
                lines.append(f"| {r.get('engine', 'eager')} | {r['batch']} | {r['drafter']} | {kv} | {t['steps']} | "
                             f"{t['step_ms']:.3f} | {t['gap_ms']:.3f} |")
    if res.get("serving"):
        sv = res["serving"]
        lines += ["", f"Serving: {sv[0]['requests']} requests of {res.get('serve_prompts')} through B slots, continuous "
                  f"batching (stop at EOS, at most {res['new_tokens']} new tokens), prefills included:", "",
                  "| engine | slots | harvest | drafter | τ | tok/s | plain tok/s | speedup | speedup ÷ τ | target steps | "
                  "lossless |", "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in sv:
            lines.append(f"| {r['engine']} | {r['batch']} | {r.get('harvest', 'sync')} | {r['drafter']} | {r['tau']:.2f} | "
                         f"{r['tokens_per_s']:,.0f} | "
                         f"{r['plain_tokens_per_s']:,.0f} | {r['speedup']:.2f}× | {r['speedup_over_tau']:.2f} | "
                         f"{r['steps']} | {'yes' if r['lossless'] else '**no**'} |")
        cats = sorted({c for r in sv for c in r["tau_by_category"]})
        drafted = [r for r in sv if r["drafter"] != "plain"]
        if drafted and cats:
            lines += ["", "Serving τ per category:", "", "| engine | slots | drafter | " + " | ".join(cats) + " |",
                      "|---|---:|---|" + "---:|" * len(cats)]
            for r in drafted:
                lines.append(f"| {r['engine']} | {r['batch']} | {r['drafter']} | "
                             + " | ".join(f"{r['tau_by_category'].get(c, 0):.2f}" for c in cats) + " |")
    if res.get("hf"):
        lines += ["", "| batch | HF generate tok/s | engine plain tok/s | engine ÷ HF |", "|---:|---:|---:|---:|"]
        for b, hf in res["hf"].items():
            eng = eager_plain[int(b)]
            lines.append(f"| {b} | {hf['tokens_per_s']:,.1f} | {eng:,.1f} | {eng / hf['tokens_per_s']:.1f}× |")
    return "\n".join(lines)


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    # speedup over the first engine's plain decoding, so a compiled engine's own gain shows too
    first = res.get("engines", ["eager"])[0]
    plain = {r["batch"]: r["tokens_per_s"] for r in res["rows"] if r["drafter"] == "plain"
             and r.get("engine", "eager") == first}
    names = list(dict.fromkeys((r.get("engine", "eager"), r["drafter"]) for r in res["rows"]
                               if not (r["drafter"] == "plain" and r.get("engine", "eager") == first)))
    colors: dict = {}                               # one colour per drafter: its static and served lines alike

    def color(name):
        return colors.setdefault(name, f"C{len(colors)}")

    for eng, name in names:
        rows = [r for r in res["rows"] if r["drafter"] == name and r.get("engine", "eager") == eng]
        ax.plot([r["batch"] for r in rows], [r["tokens_per_s"] / plain[r["batch"]] for r in rows], marker="o",
                color=color(name if len(res.get("engines", ["eager"])) == 1 else (name, eng)),
                label=name if len(res.get("engines", ["eager"])) == 1 else f"{name}, {eng}")
    serving = [r for r in res.get("serving", []) if r["drafter"] != "plain" and r["engine"] == first]
    for name in dict.fromkeys(r["drafter"] for r in serving):
        rows = [r for r in serving if r["drafter"] == name]
        ax.plot([r["batch"] for r in rows], [r["speedup"] for r in rows], marker="s", ls=":", color=color(name),
                label=f"{name}, served")
    ax.axhline(1.0, color="grey", lw=1, ls="--", label=f"plain, {first}")
    ax.set_xscale("log", base=2)
    batches = sorted({r["batch"] for r in res["rows"]})
    ax.set_xticks(batches)
    ax.set_xticklabels([str(b) for b in batches])
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(f"{res['target']}, {res['device']}, k={res['k']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
