"""The helper scripts of benchmarks/: offline-vs-online loss curves, where synthesized duplicates come from, the
reference run's summary and sweep, run-relative paths in result files, and the GPU scripts' arguments."""
import importlib.util
import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _metrics(path, losses, eval_losses, tps):
    rows = [{"split": "train", "step": i + 1, "loss": x, "tokens_per_s": tps} for i, x in enumerate(losses)]
    rows += [{"split": "eval", "step": s, "loss": x} for s, x in eval_losses]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_loss_curves_compared_step_by_step(tmp_path):
    mod = _load("compare_loss_curves")
    a = _metrics(tmp_path / "a.jsonl", [4.0, 3.0, 2.0], [(0, 5.0), (3, 2.5)], 100.0)
    b = _metrics(tmp_path / "b.jsonl", [4.0, 3.3, 2.0, 1.0], [(0, 5.0), (3, 2.0)], 40.0)
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    assert mod.main([str(a), str(b), "--labels", "offline,online", "--out", str(out), "--plot", str(png)]) == 0
    res = json.loads(out.read_text())
    assert res["train"]["steps"] == [1, 2, 3]                 # only the steps both logged
    assert abs(res["train"]["max_abs_diff"] - 0.3) < 1e-9
    assert abs(res["eval"]["max_rel_diff"] - 0.2) < 1e-9
    assert (res["median_tokens_per_s_a"], res["median_tokens_per_s_b"]) == (100.0, 40.0)
    assert png.stat().st_size > 0
    assert mod.main(["--from", str(out), "--plot", str(tmp_path / "d.png")]) == 0


def test_duplicates_are_traced_to_their_opener(tmp_path):
    mod = _load("synth_duplicates")
    openers = {"qa": ["", "What is", "Explain {topic} simply."]}
    kept = [{"category": "qa", "turns": ["Explain rain simply."]}, {"category": "qa", "turns": ["What is rain?"]},
            {"category": "qa", "turns": ["Tell me a joke"]}, {"category": "summarize", "turns": ["Summarize: ..."]}]
    dropped = [{"category": "qa", "reason": "exact_duplicate", "turns": ["Explain rain simply."]},
               {"category": "qa", "reason": "near_duplicate", "turns": ["Explain snow simply."]},
               {"category": "qa", "reason": "no_end", "turns": ["What is the"]},
               {"category": "qa", "reason": "too_short", "turns": []}]
    res = mod.analyse(kept, dropped, openers)
    top = res["by_opener"][0]
    assert (top["opener"], top["attempts"], top["duplicates"]) == ("Explain {topic} simply.", 3, 2)
    rows = {(r["category"], r["opener"]): r for r in res["by_opener"]}
    assert rows[("qa", "What is")]["attempts"] == 2 and rows[("qa", "What is")]["duplicates"] == 0
    assert rows[("summarize", "")]["attempts"] == 1
    assert res["duplicates"] == 2 and abs(res["near_duplicate_rate"] - 2 / 6) < 1e-9


def test_reference_summary_reads_the_ablation_heads_and_their_data(tmp_path):
    import sys
    sys.path.insert(0, str(REPO / "benchmarks"))  # reference_summary imports sweep_reference beside it
    mod = _load("reference_summary")
    ab = tmp_path / "ablation"
    for name, tau in (("eagle3_ttt1", 1.5), ("answers_original", 1.2)):
        (ab / f"train_{name}").mkdir(parents=True)
        rows = [{"split": "train", "step": 1, "loss": 3.0, "tokens": 1000, "tokens_per_s": 50.0},
                {"split": "eval", "step": 1, "loss": 2.0, "sim_tau": tau}]
        (ab / f"train_{name}" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (ab / "answers" / "rows_original").mkdir(parents=True)
    (ab / "answers" / "rows_original" / "summary.json").write_text(json.dumps(
        {"rows": 25, "tokens": 4186, "masked_tokens": 2267, "holdout": 3, "truncated": 0, "sources": {}}))
    (ab / "answers" / "dump_regenerated_fp8").mkdir()
    (ab / "answers" / "dump_regenerated_fp8" / "manifest.json").write_text(json.dumps(
        {"dtype": "fp8", "counts": {"tokens": 2743, "bytes": 6378443, "rows": 25}}))
    (ab / "answers" / "regenerated.jsonl").write_text("")  # a file beside the directories is not a data set
    res = mod.ablation(ab)
    assert res["heads"]["answers_original"]["heldout_sim_tau"] == 1.2
    assert res["heads"]["eagle3_ttt1"]["train_tokens"] == 1000
    assert res["answers"] == {"dump_regenerated_fp8": {"dtype": "fp8", "tokens": 2743, "bytes": 6378443},
                              "rows_original": {"rows": 25, "tokens": 4186, "masked_tokens": 2267, "holdout": 3,
                                                "truncated": 0}}
    assert res["online_vs_offline"] is None


def _run(name, fraction, tau, tokens, tps=1000.0):
    return {"name": name, "fraction": fraction, "lr": 0.002, "train_dir": f"/gpu/{name}", "seconds": 1.0,
            "heldout_sim_tau": tau, "heldout_loss": 10.0 / tau, "train_tokens": tokens, "train_tokens_per_s": tps}


def _eval_set(tau):
    return {"prompts": {"count": 2}, "settings": {}, "baseline_tokens_per_s": 10.0,
            "drafters": {"head": {"tau": tau, "alpha": [0.5], "per_category": None}}}


def test_reference_summary_amends_a_run_with_a_later_sweep_and_earlier_figures(tmp_path):
    import sys
    sys.path.insert(0, str(REPO / "benchmarks"))
    mod = _load("reference_summary")
    # this run: the full-data head evaluated, the extras not run; the 30% point trained afterwards
    final = _run("f1_lr0.002", 1.0, 3.7, 66_000_000, tps=162_000.0)
    here = {"title": "t", "date": "2026-12-06 07:38 UTC", "machine": {"gpu": "H100"},
            "data": {"rows": {"rows": 41272, "tokens": 13_476_672}}, "stages": {},
            "eval_sets": {"vicuna": _eval_set(2.14), "gsm8k_holdout": _eval_set(2.9),
                          "vicuna_k5": {"not_run": True, "dir": "/gpu/eval_extras"}},
            "goals": {}, "training": {"chosen_lr": 0.002, "runs": [final], "final": final}}
    (tmp_path / "here.json").write_text(json.dumps(here))
    late = tmp_path / "sweep30"
    late.mkdir()
    (late / "sweep.json").write_text(json.dumps({"runs": [_run("f0.3_lr0.002", 0.3, 2.1, 20_000_000)],
                                                 "best_lr": 0.002, "final": None}))
    # an earlier run on other rows: its k = 5 eval, its ablations, its own 100% point and an eval set that
    # this one ran too (which must not replace this one's)
    earlier = {"date": "2026-12-06 03:09 UTC", "machine": {"gpu": "H100"},
               "data": {"rows": {"rows": 25114, "tokens": 8_111_202}},
               "eval_sets": {"vicuna_k5": _eval_set(2.2), "vicuna": _eval_set(2.06)},
               "training": {"runs": [_run("f1_lr0.002", 1.0, 3.4, 39_700_000)]},
               "ablation": {"heads": {"mtp": {"heldout_sim_tau": 1.6}}},
               # its curve: its own run again, and a point it carried from a third summary
               "curve": [{"data_tokens": 8_111_202, "fraction": 1.0, "lr": 0.002, "train_tokens": 39_700_000,
                          "heldout_sim_tau": 3.4, "summary": "this run"},
                         {"data_tokens": 8_111_202, "fraction": 0.1, "lr": 0.002, "train_tokens": 4_000_000,
                          "heldout_sim_tau": 1.5, "summary": "third.json"}]}
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    png = tmp_path / "curve.png"
    out = mod.main(["--from-summary", str(tmp_path / "here.json"), "--sweep", str(late), "--carry-over",
                    str(tmp_path / "earlier.json"), "--plot", str(png), "--out", str(tmp_path / "ref.json")])
    assert json.loads((tmp_path / "ref.json").read_text()) == out
    assert out["date"] == "2026-12-06 07:38 UTC" and out["amended"]["date"]  # the figures' date stays
    assert out["training"]["final"]["name"] == "f1_lr0.002"
    assert [r["name"] for r in out["training"]["runs"]] == ["f1_lr0.002", "f0.3_lr0.002"]
    assert out["eval_sets"]["vicuna"]["drafters"]["head"]["tau"] == 2.14
    k5 = out["eval_sets"]["vicuna_k5"]
    assert k5["drafters"]["head"]["tau"] == 2.2 and k5["carried_over"]["date"] == "2026-12-06 03:09 UTC"
    assert out["ablation"]["heads"]["mtp"]["heldout_sim_tau"] == 1.6
    assert out["ablation"]["carried_over"]["file"] == str(tmp_path / "earlier.json")
    assert "carried_over" not in out["eval_sets"]["vicuna"]
    assert out["goals"]["gsm8k_holdout_tau>=2.8"] == {"value": 2.9, "met": True}
    assert out["goals"]["vicuna_tau>=2.5"] == {"value": 2.14, "met": False}
    # the curve keeps the two data sets apart: the earlier 100% point is not this data set's
    # and says which summary trained each point
    curve = [(p["data_tokens"], p["fraction"], p["heldout_sim_tau"], p["summary"]) for p in out["curve"]]
    assert curve == [(8_111_202, 0.1, 1.5, "third.json"), (8_111_202, 1.0, 3.4, str(tmp_path / "earlier.json")),
                     (13_476_672, 0.3, 2.1, "this run"), (13_476_672, 1.0, 3.7, "this run")]
    assert png.stat().st_size > 10_000
    # amending the amended summary again keeps the points it carried
    again = mod.main(["--from-summary", str(tmp_path / "ref.json"), "--out", str(tmp_path / "ref_again.json")])
    assert again["curve"] == out["curve"] and again["eval_sets"] == out["eval_sets"]
    with pytest.raises(SystemExit):  # one source of figures, not two
        mod.main(["--from-summary", str(tmp_path / "ref.json"), "--run", str(tmp_path), "--out", str(tmp_path / "x")])
    # a goal set known only from an earlier head is not this head's result; a section that names the summary it
    # was measured in (the ablations) is marked with that one
    del here["eval_sets"]["vicuna"]
    (tmp_path / "here.json").write_text(json.dumps(here))
    earlier["ablation"]["summary_file"] = "ablations/reference.json"
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    out = mod.main(["--from-summary", str(tmp_path / "here.json"), "--carry-over", str(tmp_path / "earlier.json"),
                    "--out", str(tmp_path / "ref2.json")])
    assert out["eval_sets"]["vicuna"]["carried_over"] and out["goals"]["vicuna_tau>=2.5"]["value"] is None
    assert out["ablation"]["carried_over"]["file"] == "ablations/reference.json"


def test_reference_summary_puts_parallel_heads_beside_its_head(tmp_path):
    """--parallel: each evaluated head of a gpu_parallel.sh summary joins this run's EAGLE-3 head, labelled by its
    file, with its runtime speedups and training figures; each file says where it was measured and how its rows
    compare with this run's. A head that was never evaluated stays out; a missing file is an error."""
    import sys
    sys.path.insert(0, str(REPO / "benchmarks"))
    mod = _load("reference_summary")
    final = _run("f1_lr0.002", 1.0, 3.7, 66_000_000, tps=162_000.0)
    mixed = _eval_set(2.57)
    mixed["drafters"]["head"]["k"] = 3
    mixed["drafters"]["ngram"] = {"tau": 1.69, "k": 3, "per_category": None}
    here = {"title": "t", "date": "2026-12-06 07:38 UTC", "machine": {"gpu": "H100"},
            "data": {"rows": {"rows": 41272, "tokens": 13_476_672}}, "stages": {}, "eval_sets": {"mixed": mixed},
            "goals": {}, "training": {"chosen_lr": 0.002, "runs": [final], "final": final}}
    (tmp_path / "here.json").write_text(json.dumps(here))

    def head(tau, runtime=None, **training):
        e = {"k": 15, "tau": tau, "ngram_tau": 1.96, "alpha": [0.5], "per_category": {}, "lossless": {"total": 1},
             "speedup": 0.3, "every_category_ratio_met": False}
        return {"kind": "dflash", "training": {"tokens_per_s_median": 1e5, "lr": 2e-3, **training},
                "evals": {"mixed": e, "vicuna": dict(e, tau=tau - 0.2), "gsm8k": "not run"}, "runtime": runtime}

    runtime = _runtime([("compiled", 1, "plain", 1.0, 900.0, 1.0, True),
                        ("compiled", 1, "head (dflash)", 1.8, 890.0, 0.99, True),
                        ("compiled", 8, "head (dflash)", 1.6, 5000.0, 0.84, True)])
    first = {"created": "2026-12-07T19:44:44+00:00", "machine": {"gpu": "H100"}, "data": "not found",
             "goals": {"dflash_tau_mixed>=4.0": {"value": 1.81, "met": False}},
             "heads": {"dflash_b16": head(1.81, runtime, dflash_anchors=2048), "peagle": "not run",
                       "peagle_k8": {"kind": "peagle", "training": None, "evals": {"mixed": "not run"}}}}
    second = {"created": "2026-12-07T22:05:48+00:00", "machine": {"gpu": "H100"},
              "data": {"rows": 41270, "tokens": 13_441_235},
              "heads": {"dflash_b16": head(1.89, dflash_anchors=8192, dflash_attention="flex")}}
    for name, d in (("reference_rows", first), ("flex8192", second)):
        (tmp_path / f"{name}.json").write_text(json.dumps(d))
    out = mod.main(["--from-summary", str(tmp_path / "here.json"), "--parallel", str(tmp_path / "reference_rows.json"),
                    "--parallel", str(tmp_path / "flex8192.json"), "--out", str(tmp_path / "ref.json")])
    par = out["parallel"]
    assert list(par["heads"]) == ["dflash_b16 (reference_rows)", "dflash_b16 (flex8192)"]
    src = par["sources"]
    assert src["reference_rows"]["data"] == "not recorded" and src["reference_rows"]["tokens_vs_this_run"] is None
    assert src["flex8192"]["tokens_vs_this_run"] == pytest.approx(13_441_235 / 13_476_672)
    assert src["reference_rows"]["goals"]["dflash_tau_mixed>=4.0"]["met"] is False
    h = par["heads"]["dflash_b16 (flex8192)"]
    assert h["training"]["dflash_attention"] == "flex" and h["runtime"] == {"batch1": None, "batch8": None,
                                                                            "served8": None}
    assert set(h["evals"]) == {"mixed", "vicuna"}
    rows = [(r["head"], r["set"], r["k"], r["tau"], r["batch1_speedup"], r["batch8_speedup"], r["train_tokens_per_s"])
            for r in par["side_by_side"]]
    assert rows == [("eagle3 (this run)", "mixed", 3, 2.57, None, None, 162_000.0),
                    ("dflash_b16 (reference_rows)", "mixed", 15, 1.81, 0.99, 0.84, 1e5),
                    ("dflash_b16 (reference_rows)", "vicuna", 15, pytest.approx(1.61), 0.99, 0.84, 1e5),
                    ("dflash_b16 (flex8192)", "mixed", 15, 1.89, None, None, 1e5),
                    ("dflash_b16 (flex8192)", "vicuna", 15, pytest.approx(1.69), None, None, 1e5)]
    assert par["side_by_side"][0]["ngram_tau"] == 1.69
    # this run's own runtime benchmark gives its head's speedups
    (tmp_path / "rt.json").write_text(json.dumps(_runtime([("compiled", 1, "head (eagle3)", 2.2, 1500.0, 1.5, True)])))
    with_rt = mod.main(["--from-summary", str(tmp_path / "ref.json"), "--bench-runtime", str(tmp_path / "rt.json"),
                        "--out", str(tmp_path / "ref_rt.json")])
    assert with_rt["parallel"]["side_by_side"][0]["batch1_speedup"] == 1.5
    # amending the result again keeps the parallel heads and rebuilds the table from them
    again = mod.main(["--from-summary", str(tmp_path / "ref.json"), "--out", str(tmp_path / "ref2.json")])
    assert again["parallel"] == par
    with pytest.raises(SystemExit):
        mod.main(["--from-summary", str(tmp_path / "here.json"), "--parallel", str(tmp_path / "nope.json"),
                  "--out", str(tmp_path / "x.json")])
    # gpu_parallel.sh's own parallel.json takes its folder's name; the same label from two files is refused
    for run in ("runA", "runB"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "parallel.json").write_text(json.dumps(second))
    two = mod.main(["--from-summary", str(tmp_path / "here.json"), "--parallel", str(tmp_path / "runA/parallel.json"),
                    "--parallel", str(tmp_path / "runB/parallel.json"), "--out", str(tmp_path / "two.json")])
    assert list(two["parallel"]["heads"]) == ["dflash_b16 (runA)", "dflash_b16 (runB)"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "flex8192.json").write_text(json.dumps(second))
    with pytest.raises(SystemExit):
        mod.main(["--from-summary", str(tmp_path / "ref.json"), "--parallel", str(tmp_path / "other/flex8192.json"),
                  "--out", str(tmp_path / "x.json")])
    # a source given again replaces its heads: one no longer evaluated leaves
    second["heads"]["dflash_b16"]["evals"] = {"mixed": "not run"}
    (tmp_path / "flex8192.json").write_text(json.dumps(second))
    redone = mod.main(["--from-summary", str(tmp_path / "ref.json"), "--parallel", str(tmp_path / "flex8192.json"),
                       "--out", str(tmp_path / "x.json")])
    assert list(redone["parallel"]["heads"]) == ["dflash_b16 (reference_rows)"]
    # an EAGLE-3 eval set carried over from an earlier summary is not this run's, and no n-gram is no crash
    here["eval_sets"]["mixed"]["carried_over"] = {"file": "old/earlier.json"}
    del here["eval_sets"]["mixed"]["drafters"]["ngram"]
    (tmp_path / "here.json").write_text(json.dumps(here))
    old = mod.main(["--from-summary", str(tmp_path / "here.json"), "--parallel", str(tmp_path / "flex8192.json"),
                    "--out", str(tmp_path / "x.json")])
    assert old["parallel"]["side_by_side"][0]["head"] == "eagle3 (earlier)"
    assert old["parallel"]["side_by_side"][0]["ngram_tau"] is None
    assert old["parallel"]["side_by_side"][0]["train_tokens_per_s"] is None


def test_sweep_resumes_after_an_interruption(tmp_path, monkeypatch):
    """A sweep killed mid-way: the rerun skips the finished runs, resumes the interrupted one from its checkpoint
    (train.resume=true) and ends as an uninterrupted sweep would; another sweep in the same --out is refused."""
    import subprocess
    import sys
    sys.path.insert(0, str(REPO / "benchmarks"))
    mod = _load("sweep_reference")
    calls, kill = [], {"at": "f1_lr0.002"}

    def fake_train(cmd, check):
        args = dict(a.split("=", 1) for a in cmd if "=" in a)
        out = Path(args["train.out"])
        calls.append((out.name, args["train.resume"]))
        (out / "checkpoints").mkdir(parents=True, exist_ok=True)
        if kill.get("at") == out.name:
            del kill["at"]
            raise subprocess.CalledProcessError(-9, cmd)
        frac, lr = float(args["train.data_fraction"]), float(args["train.lr"])
        rows = [{"split": "train", "step": 1, "loss": 3.0, "tokens": int(1000 * frac), "tokens_per_s": 10.0},
                {"split": "eval", "step": 1, "loss": 2.0, "sim_tau": 1 + frac + lr * 100, "step_acc": [0.5]}]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    monkeypatch.setattr(mod.subprocess, "run", fake_train)
    argv = ["recipes/x.yaml", "--out", str(tmp_path / "sw"), "--fractions", "0.1,1", "--lrs", "1e-3,2e-3", "a.b=1"]
    with pytest.raises(subprocess.CalledProcessError):
        mod.main(argv)
    state = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert [r["name"] for r in state["runs"]] == ["f0.1_lr0.001", "f0.1_lr0.002"]  # kept as they finished
    calls.clear()
    state = mod.main(argv)
    assert calls == [("f1_lr0.002", "true")]  # the finished runs are not trained again
    assert state["best_lr"] == 0.002 and state["final"]["name"] == "f1_lr0.002"
    assert state["final"]["heldout_sim_tau"] == pytest.approx(2.2)
    assert (tmp_path / "sw" / "sweep.md").read_text().count("\n") == 5
    with pytest.raises(SystemExit, match="belongs to another sweep"):
        mod.main([*argv[:-1], "a.b=2"])


def test_reference_summary_writes_run_relative_paths(tmp_path, monkeypatch):
    """A summary names the run's files relative to the run directory, whatever absolute path the run had; paths
    under the working directory become relative to it and those under the home directory start with ~."""
    import sys
    sys.path.insert(0, str(REPO / "benchmarks"))
    mod = _load("reference_summary")
    run = tmp_path / "somewhere" / "run"
    (run / "data" / "rows").mkdir(parents=True)
    (run / "data" / "synthesize_summary.json").write_text(json.dumps(
        {"out": str(run / "data" / "synthesized.jsonl"), "written": 3}))
    (run / "data" / "rows" / "summary.json").write_text(json.dumps(
        {"rows": 3, "tokens": 90, "tokenizer": str(Path.home() / ".cache" / "x" / "tokenizer"),
         "sources": {str(run / "data" / "regenerated.jsonl"): {"rows": 3}}}))
    (run / "sweep").mkdir()
    (run / "sweep" / "sweep.json").write_text(json.dumps(
        {"runs": [_run("f1_lr0.002", 1.0, 2.0, 1000) | {"train_dir": str(run / "sweep" / "f1_lr0.002")}],
         "best_lr": 0.002, "final": None}))
    monkeypatch.chdir(tmp_path)
    out = mod.main(["--run", str(run), "--out", str(tmp_path / "ref.json"), "--sweep", str(run / "sweep"),
                    "--eval", f"mixed={run / 'eval_mixed'}", "--eval", f"other={tmp_path / 'elsewhere'}"])
    assert json.loads((tmp_path / "ref.json").read_text()) == out
    assert out["data"]["synthesize"]["out"] == "data/synthesized.jsonl"
    assert out["data"]["rows"]["sources"] == {"data/regenerated.jsonl": {"rows": 3}}
    assert out["data"]["rows"]["tokenizer"] == "~/.cache/x/tokenizer"
    assert out["training"]["runs"][0]["train_dir"] == "sweep/f1_lr0.002"
    assert out["eval_sets"]["mixed"] == {"not_run": True, "dir": "eval_mixed"}
    assert out["eval_sets"]["other"]["dir"] == "elsewhere"          # under the working directory
    assert str(tmp_path) not in (tmp_path / "ref.json").read_text()


def test_run_paths_leave_other_strings_alone(tmp_path):
    import sys
    sys.path.insert(0, str(REPO / "benchmarks"))
    from run_paths import relative

    run = tmp_path / "r"
    got = relative({"a": str(run), "b": [str(run / "x" / "y.json"), "plain text", "/opt/other/file", 3],
                    str(run / "k"): None, "c": str(tmp_path / "rx" / "f")}, run)
    assert got == {"a": ".", "b": ["x/y.json", "plain text", "/opt/other/file", 3], "k": None,
                   "c": str(tmp_path / "rx" / "f")}


@pytest.mark.parametrize("script", ["gpu_reference.sh", "gpu_runtime.sh", "gpu_parallel.sh"])
def test_gpu_scripts_refuse_a_missing_gguf(tmp_path, script):
    """The GPU scripts take the GGUF (and the reference run its prompt folder) as arguments and refuse a path that
    is not there before anything runs."""
    import subprocess

    data = script in ("gpu_reference.sh", "gpu_parallel.sh")
    args = [str(tmp_path / "none.gguf")] + ([str(tmp_path)] if data else []) + [str(tmp_path / "o")]
    out = subprocess.run(["bash", str(REPO / "benchmarks" / script), *args], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "GGUF file not found" in out.stderr
    if data:
        out = subprocess.run(["bash", str(REPO / "benchmarks" / script), "", str(tmp_path / "nodata"),
                              str(tmp_path / "o")], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "no prompt folder" in out.stderr


@pytest.mark.parametrize("heads", ["eagle3", "dflash:x", "peagle:0", "medusa:4"])
def test_gpu_parallel_refuses_a_malformed_head(tmp_path, heads):
    """gpu_parallel.sh takes HEADS as kind:size and refuses anything else (exit 2, naming the entry) before a stage
    runs: a bare kind would train under a size of its own name, a non-number fails in the shell's arithmetic."""
    import subprocess

    out = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_parallel.sh"), "", str(tmp_path), str(tmp_path / "o")],
                         cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "HEADS": heads})
    assert out.returncode == 2 and f"HEADS: '{heads}'" in out.stderr, out.stderr
    assert not (tmp_path / "o" / "timeline.txt").exists()


@pytest.mark.parametrize("tag", ["a/b", "x y", "../up", "*"])
def test_gpu_parallel_refuses_a_tag_that_is_no_file_name_part(tmp_path, tag):
    """TAG suffixes each head's files (dflash_b16_TAG): a path separator, a space or a glob character is refused
    before a stage runs."""
    import subprocess

    out = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_parallel.sh"), "", str(tmp_path), str(tmp_path / "o")],
                         cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "TAG": tag})
    assert out.returncode == 2 and f"TAG: '{tag}'" in out.stderr, out.stderr
    assert not (tmp_path / "o" / "timeline.txt").exists()


def test_inputs_key_follows_the_files_a_stage_reads(tmp_path):
    """gpu_setup.sh's inputs_key (the GPU scripts skip a stage that finished before with the same key): it changes
    with an argument and with the content of a file an argument names, bare or as KEY=FILE, and not with files under
    the run directory (earlier stages' outputs) or with a file of 64 MB or more (a GGUF)."""
    import subprocess

    run, recipe, prompts, big = tmp_path / "run", tmp_path / "r.yaml", tmp_path / "p.jsonl", tmp_path / "t.gguf"
    run.mkdir()
    (run / "rows.jsonl").write_text("x")
    recipe.write_text("a")
    prompts.write_text("p")
    with open(big, "wb") as f:
        f.truncate(64 << 20)

    def key(*args):
        out = subprocess.run(["bash", "-c", f'. benchmarks/gpu_setup.sh; inputs_key "$@"', "k", str(run), *args],
                             cwd=REPO, capture_output=True, text=True, timeout=30, check=True)
        return out.stdout.strip()

    args = ("data", "prepare", str(recipe), f"data.sources.0.path={prompts}", f"x={run / 'rows.jsonl'}",
            f"target.source={big}")
    k0 = key(*args)
    assert len(k0) == 16 and key(*args) == k0
    assert key(*args, "train.epochs=3") != k0
    (run / "rows.jsonl").write_text("y")
    with open(big, "r+b") as f:
        f.write(b"GGUF")
    assert key(*args) == k0
    recipe.write_text("b")
    k1 = key(*args)
    assert k1 != k0
    prompts.write_text("q")
    assert key(*args) not in (k0, k1)


def test_finished_before_skips_only_an_unchanged_finished_stage(tmp_path):
    """gpu_setup.sh's finished_before (both GPU scripts' stage skip): a stage is skipped when its marker holds the
    same key, its output (if named) is there and no stage ran again earlier in the invocation; otherwise the marker
    goes and RAN is set, so every later stage runs too."""
    import subprocess

    out = tmp_path / "rows.json"
    out.write_text("{}")
    script = f"""
. benchmarks/gpu_setup.sh; DONE={tmp_path}/.stages; RAN=; log() {{ echo "$*"; }}
check() {{ if finished_before "$@"; then echo SKIP; else echo RUN; fi; }}
check s1 k1 {out}; echo k1 > $DONE/s1                # first time: runs, then marked
RAN=; check s1 k1 {out}; check s1 k2 {out}          # same key: skipped; another key: runs
RAN=; check s1 k1 {out}                              # the failed or changed run took the marker away
echo k1 > $DONE/s1; RAN=; rm {out}; check s1 k1 {out}  # the output is gone
echo k1 > $DONE/s1; RAN=1; check s1 k1              # a stage ran again before it
echo k1 > $DONE/s1; RAN=; check s1 k1; echo "RAN=$RAN"
"""
    got = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=30, check=True)
    assert [w for w in got.stdout.split() if w in ("SKIP", "RUN")] == ["RUN", "SKIP", "RUN", "RUN", "RUN", "RUN",
                                                                         "SKIP"], got.stdout
    assert "skip s1 (finished before)" in got.stdout and got.stdout.rstrip().endswith("RAN=")


def test_gpu_qwen_refuses_missing_inputs_before_any_stage(tmp_path):
    """gpu_qwen.sh names every missing data file, a missing GGUF source, a parts folder lacking parts and a joined
    file of the wrong sha256, each with exit 2 and before a stage runs (no timeline is written)."""
    import subprocess

    def run(src, data, env=None):
        return subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_qwen.sh"), str(src), str(data),
                               str(tmp_path / "o")], cwd=REPO, capture_output=True, text=True, timeout=120,
                              env={**os.environ, **(env or {})})

    data = tmp_path / "data"
    data.mkdir()
    (data / "gsm8k_train.jsonl").write_text("")
    out = run(tmp_path / "parts", data)
    assert out.returncode == 2
    assert "new_codealpaca.json code_alpaca_2k.json vicuna_bench_questions.jsonl" in out.stderr
    for f in ("new_codealpaca.json", "code_alpaca_2k.json", "vicuna_bench_questions.jsonl"):
        (data / f).write_text("")
    out = run(tmp_path / "parts", data)
    assert out.returncode == 2 and "GGUF parts folder or file not found" in out.stderr
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "part01.bin").write_bytes(b"GGUF")
    out = run(parts, data)
    assert out.returncode == 2 and "part" in out.stderr and "22" in out.stderr, out.stderr
    joined = tmp_path / "joined.gguf"
    joined.write_bytes(b"GGUF" + b"\0" * 64)
    out = run(joined, data)
    assert out.returncode == 2 and "sha256" in out.stderr, out.stderr
    # a head variant must be named (TAG), and the name must not hold the '_' that separates it from its kind
    out = run(joined, data, {"LR": "1e-3"})
    assert out.returncode == 2 and "LR=1e-3 needs a TAG" in out.stderr, out.stderr
    out = run(joined, data, {"LR": "1e-3", "TAG": "lr_1e-3"})
    assert out.returncode == 2 and "TAG: 'lr_1e-3'" in out.stderr, out.stderr
    assert not (tmp_path / "o" / "timeline.txt").exists()


def test_gpu_scripts_name_no_machine_paths():
    """The GPU scripts and the recipe they run hold no path of a particular machine."""
    machine_paths = ["/tmp/", "/" + "root/", "/" + "work/", ".." + "/shared"]
    for f in [*(REPO / "benchmarks").glob("*.sh"), REPO / "recipes" / "smollm2_eagle3_gpu.yaml"]:
        text = f.read_text()
        assert not [p for p in machine_paths if p in text], f.name


def test_parallel_summary_reads_each_heads_reports(tmp_path):
    """parallel_summary.py: per head (kind and size, or a bare kind in older runs) the eval report (τ, n-gram's,
    per-category ratio, lossless), the training metrics (tok/s, held-out τ) and its recipe's lr and anchors; a kind
    with nothing on disk is 'not run', and so is every goal it feeds; a goal takes each kind's best head and pairs
    P-EAGLE with EAGLE-3 at the same k only."""
    mod = _load("parallel_summary")
    root = tmp_path / "parallel"
    report = json.loads((REPO / "benchmarks/results/smollm2_reference/eval_mixed/report.json").read_text())
    rows = [{"split": "train", "step": 1, "tokens_per_s": 100.0}, {"split": "train", "step": 2, "tokens_per_s": 300.0},
            {"split": "eval", "step": 2, "sim_tau": 1.7, "step_acc": [0.5]}]
    for head in ("eagle3", "peagle_k3", "peagle_k8"):
        rep = json.loads(json.dumps(report))
        if head == "peagle_k8":    # another k: no EAGLE-3 head to compare with
            for run in rep["runs"]:
                run["k"] = 8
        (root / f"eval_{head}_mixed").mkdir(parents=True)
        (root / f"eval_{head}_mixed" / "report.json").write_text(json.dumps(rep))
        (root / f"train_{head}" / "final").mkdir(parents=True)
        (root / f"train_{head}" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "train_peagle_k3" / "final" / "meta.json").write_text(json.dumps(
        {"recipe": {"train": {"lr": 6e-4, "epochs": 2, "dflash_anchors": 2048, "dflash_attention": "flex",
                              "data_fraction": 1.0}}}))
    # a worse EAGLE-3 head at the same k under the new name: the goal pairs P-EAGLE with the better one, once
    worse = json.loads(json.dumps(report))
    for run in worse["runs"]:
        run["metrics"]["tau"] = 1.5
    (root / "eval_eagle3_k3_mixed").mkdir()
    (root / "eval_eagle3_k3_mixed" / "report.json").write_text(json.dumps(worse))
    # runtime benchmarks that do not say their k: the head's eval k stands in
    for head, speedup in (("eagle3", 1.0), ("peagle_k3", 1.3), ("peagle_k8", 2.0)):
        (root / f"runtime_{head}.json").write_text(json.dumps(
            {"rows": [{"batch": 1, "drafter": f"head ({head})", "speedup": speedup, "tau": 1.5, "tokens_per_s": 900.0,
                       "lossless": True}]}))
    # trained, not evaluated (yet): its own row, and the kind is no longer 'not run'
    (root / "train_dflash_b16" / "final").mkdir(parents=True)
    (root / "train_dflash_b16" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "train_dflash_b16" / "final" / "meta.json").write_text(json.dumps(
        {"recipe": {"train": {"lr": 2e-3, "epochs": 4, "dflash_anchors": 8192, "dflash_attention": "flex",
                              "scheduler": "constant", "max_tokens_per_batch": 16384}}}))
    (tmp_path / "timeline.txt").write_text("[10:00:00] end train_eagle3 rc=0 78s\n")
    (tmp_path / "data" / "rows").mkdir(parents=True)      # the run's token rows, beside its parallel/ directory
    (tmp_path / "data" / "rows" / "summary.json").write_text(json.dumps({"rows": 7, "tokens": 700, "sources": {}}))
    s = mod.main([str(root), "--timeline", str(tmp_path / "timeline.txt"), "--out", str(tmp_path / "p.json"),
                  "--md", str(tmp_path / "p.md")])
    assert list(s["heads"]) == ["eagle3", "eagle3_k3", "peagle_k3", "peagle_k8", "dflash_b16"]
    e = s["heads"]["eagle3"]
    assert e["kind"] == "eagle3" and e["training"]["lr"] is None
    assert e["training"]["tokens_per_s_median"] == 200.0 and e["training"]["heldout_sim_tau"] == 1.7
    assert s["heads"]["peagle_k3"]["training"]["lr"] == 6e-4
    mixed = e["evals"]["mixed"]
    assert mixed["tau"] == pytest.approx(2.5745, abs=1e-3) and mixed["lossless"]["identical"] == 152
    assert mixed["per_category"]["code"]["ratio"] == pytest.approx(2.885 / mixed["per_category"]["code"]["ngram"],
                                                                   rel=1e-3)
    assert not mixed["every_category_ratio_met"]      # translation: 2.79 against n-gram's 2.22
    assert e["evals"]["vicuna"] == "not run" and s["heads"]["dflash_b16"]["evals"]["mixed"] == "not run"
    assert s["goals"]["dflash_tau_mixed>=4.0"] == "not run"
    same_k = s["goals"]["peagle_tau>=eagle3_tau_same_k (mixed)"]
    # equal reports at k 3 (the better EAGLE-3 head, once); K 8 has no EAGLE-3 beside it
    assert [(g["k"], g["eagle3"], g["met"]) for g in same_k] == [(3, pytest.approx(2.5745, abs=1e-3), True)]
    assert s["goals"]["peagle_speedup_batch1>=1.2x_eagle3"] == [{"k": 3, "peagle": 1.3, "eagle3": 1.0, "met": True}]
    assert s["stages"]["train_eagle3"] == {"rc": 0, "seconds": 78}
    assert s["data"] == {"rows": 7, "tokens": 700, "masked_tokens": None}
    md = (tmp_path / "p.md").read_text()
    assert "| peagle_k3 | mixed | 3 | 2.57 |" in md and "| peagle_k8 | mixed | 8 |" in md
    assert "lr 0.0006, 2 ep |" in md and "| dflash_b16 | not evaluated |" in md and "| dflash | not run |" not in md
    # the words name DFlash's anchors and a block attention other than the dense default, for DFlash alone
    assert mod._recipe(s["heads"]["dflash_b16"]) == ("lr 0.002 constant, 4 ep, 16k-token micro-batches, "
                                                     "8192 anchors, flex attention")


def _runtime(rows, serving=()):
    keys = ("engine", "batch", "drafter", "tau", "tokens_per_s", "speedup", "lossless")
    return {"device": "cuda", "dtype": "bfloat16", "k": 3, "new_tokens": 128,
            "rows": [dict(zip(keys, r)) for r in rows], "serving": [dict(zip(keys, r)) for r in serving]}


def test_qwen_summary_tabulates_and_judges_what_was_measured(tmp_path):
    """qwen_summary.py: the eval report (head against the better of n-gram and suffix), the model-free runtime and
    the head's runtime as one decode table, and each goal judged on what exists: a missing set, training or
    concurrency is 'not run', never a pass."""
    mod = _load("qwen_summary")
    run = tmp_path / "run"
    report = json.loads((REPO / "benchmarks/results/smollm2_reference/eval_mixed/report.json").read_text())
    (run / "eval_eagle3_mixed").mkdir(parents=True)
    (run / "eval_eagle3_mixed" / "report.json").write_text(json.dumps(report))
    free = tmp_path / "bench_runtime_model_free.json"
    free.write_text(json.dumps(_runtime([("compiled", 1, "plain", 1.0, 200.0, 1.0, True),
                                         ("compiled", 1, "ngram", 1.5, 270.0, 1.35, True),
                                         ("compiled", 1, "suffix", 1.6, 240.0, 1.2, True)],
                                        [("compiled", 8, "plain", 1.0, 1500.0, 1.0, True)])))
    head = tmp_path / "bench_runtime_eagle3.json"
    head.write_text(json.dumps(_runtime([("compiled", 1, "plain", 1.0, 200.0, 1.0, True),
                                         ("compiled", 1, "head (eagle3)", 3.0, 540.0, 2.7, True),
                                         ("compiled", 1, "hybrid suffix (min_match 3)", 3.2, 500.0, 2.5, True)],
                                        [("compiled", 8, "head (eagle3)", 2.8, 2400.0, 1.6, True)])))
    # a bf16 row whose output is not plain decoding's: how many sequences differ, and from which token
    rt = json.loads(free.read_text())
    rt["rows"][1].update(lossless=False, sequences_differing=2, first_difference=64, decode_speedup=1.4)
    free.write_text(json.dumps(rt))
    timeline = tmp_path / "timeline.txt"
    timeline.write_text("[10:07:14] gpu_qwen.sh KIND=eagle3 DEVICE=cuda\nNVIDIA H100 80GB HBM3, 81559 MiB\n"
                        "/dev/vda        252G   19G   62G  23% /\n[10:09:09] end target rc=0 115s\n")
    s = mod.summarize(run, timeline, None, {"model_free": free, "eagle3": head})
    assert s["run_device"] == "NVIDIA H100 80GB HBM3"      # where the stages ran, not where this summary is written
    s["goals"] = mod.goals(s)
    g = s["goals"]
    assert g["best_head_speedup_batch1>=2.5"] == {"value": 2.7, "met": True, "drafter": "eagle3: head (eagle3)"}
    assert g["best_head_speedup_served8>=1.8"]["met"] is False and g["best_head_speedup_served8>=1.8"]["value"] == 1.6
    assert g["best_head_speedup_served32>=1.3"] == "not run"
    over = g["every_drafter_speedup>=0.85_tau_batch1"]
    assert over["met"] is False and over["short"] == ["eagle3: hybrid suffix (min_match 3)", "model_free: suffix"]
    assert over["ratios"]["model_free: ngram"] == pytest.approx(0.9)
    assert g["eagle3_tau_k3_code_holdout>=3.0"] == "not run"
    assert g["online_training_mfu>=40%"] == "not measured"
    assert g["plain_batch1_within_2x_of_bandwidth_bound"] == "not run"
    md = mod.markdown(s)
    assert "| model_free | 1 | static | suffix | 1.60 | 240 | 1.20× | — | 0.75 | yes |" in md
    assert "| model_free | 1 | static | ngram | 1.50 | 270 | 1.35× | 1.40× | 0.90 | no (2 differ, first at token 64) |" in md
    assert "| eagle3 | 8 | served | head (eagle3) | 2.80 | 2,400 | 1.60× | — | 0.57 | yes |" in md
    # an earlier run's model-free figures carry over into a later head's summary, named by their date; a drafter the
    # later run timed again at the same batch and mode supersedes the carried row (suffix here), the others stay
    again = tmp_path / "bench_runtime_eagle3_again.json"
    again.write_text(json.dumps(_runtime([("compiled", 1, "plain", 1.0, 200.0, 1.0, True),
                                          ("compiled", 1, "suffix", 1.6, 300.0, 1.5, True)], [])))
    later = mod.summarize(run, None, None, {"eagle3": again})
    mod.merge(later, s, tmp_path / "earlier.json")
    assert later["model_free_runtime"]["carried_over"]["file"].endswith("earlier.json")
    carried = f"model_free (from {s['date']})"
    rows = [(src, m, r["drafter"], r["batch"]) for src, m, r in mod.speed_rows(later)]
    assert (carried, "static", "ngram", 1) in rows and (carried, "served", "plain", 8) in rows
    assert (carried, "static", "suffix", 1) not in rows and ("eagle3", "static", "suffix", 1) in rows
    assert (carried, "static", "plain", 1) in rows          # the kept n-gram row's baseline
    assert mod.goals(later)["every_drafter_speedup>=0.85_tau_batch1"]["ratios"] == {
        f"{carried}: ngram": pytest.approx(0.9), "eagle3: suffix": pytest.approx(1.5 / 1.6)}
    # suffix timed at another k supersedes nothing; an earlier summary's head brings its runtime, dated
    other_k = json.loads(again.read_text()) | {"k": 4}
    again.write_text(json.dumps(other_k))
    later = mod.summarize(run, None, None, {"eagle3": again})
    mod.merge(later, s, tmp_path / "earlier.json")
    assert (carried, "static", "suffix", 1) in [(src, m, r["drafter"], r["batch"])
                                               for src, m, r in mod.speed_rows(later)]
    (tmp_path / "empty").mkdir()
    fresh_only = mod.summarize(tmp_path / "empty", None, None, {})      # no head of its own: the earlier one's
    mod.merge(fresh_only, s, tmp_path / "earlier.json")
    assert {src for src, _, _ in mod.speed_rows(fresh_only)} == {carried, f"eagle3 (from {s['date']})"}


def test_qwen_summary_says_a_head_diverged_and_keeps_the_untrained_eval_out(tmp_path):
    """A head whose training stopped (the trainer's diverged.json) is one row saying where and why, and the
    step-0 eval of the untrained head is not reported as its held-out accuracy."""
    mod = _load("qwen_summary")
    run = tmp_path / "run"
    td = run / "train_peagle"
    td.mkdir(parents=True)
    rows = [{"split": "eval", "step": 0, "step_acc": [0.0001, 0.0], "sim_tau": 1.0},
            {"split": "train", "step": 93, "tokens_per_s": 35000.0, "loss": 19.0}]
    (td / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (td / "diverged.json").write_text(json.dumps({"what": "gradient norm is inf", "step": 94, "epoch": 1,
                                                  "rows": [3, 1], "input_ids_shape": [52, 315]}))
    s = mod.summarize(run, None, None, {})
    t = s["heads"]["peagle"]["training"]
    assert t["heldout_step_acc"] is None and t["steps"] == 93
    assert t["diverged"] == {"what": "gradient norm is inf", "step": 94, "epoch": 1, "input_ids_shape": [52, 315],
                             "rows": [3, 1]}
    s["goals"] = mod.goals(s)
    md = mod.markdown(s)
    assert ("| peagle | training diverged: gradient norm is inf at optimizer step 94 (input_ids shape [52, 315]); "
            "not evaluated |") in md
    assert "| peagle | mixed: not run |" not in md and "peagle: prompts → evaluated head" not in md
    (td / "final").mkdir()          # resumed and finished: the file left behind is stale
    assert "diverged" not in mod.summarize(run, None, None, {})["heads"]["peagle"]["training"]
    # a head trained in an earlier run and timed in this one: the earlier training and evals, this run's rows
    rt = tmp_path / "bench_runtime_peagle.json"
    rt.write_text(json.dumps(_runtime([("compiled", 1, "plain", 1.0, 200.0, 1.0, True),
                                       ("compiled", 1, "head (peagle)", 2.0, 300.0, 1.5, True)], [])))
    earlier = {"heads": {"peagle": {"training": {"steps": 400}, "evals": {"mixed": {"tau": 2.1}}, "runtime": None}},
               "date": "2026-12-07 07:54 UTC", "data": {"rows": {"rows": 4562, "tokens": 1362757}}}
    timed = tmp_path / "timed"
    timed.mkdir()
    later = mod.summarize(timed, None, None, {"peagle": rt})
    mod.merge(later, earlier, tmp_path / "earlier.json")
    h = later["heads"]["peagle"]
    assert h["training"] == {"steps": 400} and h["evals"]["mixed"]["tau"] == 2.1
    assert [r["drafter"] for r in h["runtime"]["rows"]] == ["plain", "head (peagle)"]
    # the earlier head's rows are named beside it: a run of another data size is no like-for-like comparison
    assert h["carried_over"]["rows"] == 4562
    h["evals"] = {"mixed": "not run"}        # the fixture's eval has a τ alone, not a report's full table
    later["goals"] = mod.goals(later)
    assert "| peagle (from 2026-12-07 07:54 UTC, 4,562 rows) | mixed: not run |" in mod.markdown(later)


def test_bench_runtime_says_where_drafted_output_left_plain_decoding():
    """bench_runtime's identity check: lossless, or how many sequences differ and the earliest differing token
    (a bf16 near-tie shows as one sequence from a late token on; a broken verify from token 0 in every one)."""
    identity = _load("bench_runtime").identity
    plain = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9]]
    assert identity(plain, plain) == {"lossless": True}
    assert identity([[1, 2, 3, 4], [5, 6, 0, 8], [9, 9, 9]], plain) == {
        "lossless": False, "sequences_differing": 1, "first_difference": 2}
    assert identity([[1, 2], [0, 6, 7, 8], [9, 9, 9]], plain) == {
        "lossless": False, "sequences_differing": 2, "first_difference": 0}


def test_bench_suffix_replays_answers_and_checks_every_draft(tmp_path):
    """bench_suffix.py: the answers of a prompt file replayed as generation feeds them, each draft checked
    against the stated rule (an unequal one stops the run), the host time per row and step reported; a row
    without answer text is refused, naming the file and row."""
    mod = _load("bench_suffix")

    class Words:                      # a tokenizer stand-in: one id per word
        def __init__(self):
            self.ids = {}

        def encode(self, text):
            return [self.ids.setdefault(w, len(self.ids)) for w in text.split()]

    rows = [{"question": f"q {i} add the numbers", "answer": "the sum of a and b is a plus b so a plus b " * (i + 2)}
            for i in range(6)]
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = mod.load_pairs(data, Words(), 6)
    r = mod.run(pairs, batch=4, k=3, new_tokens=40)
    assert r["row_steps"] > 0 and r["speculate_us"] > 0 and r["every_match_us"] > 0
    data.write_text(json.dumps({"question": "no answer"}) + "\n")
    with pytest.raises(SystemExit, match="qa.jsonl: row 0"):
        mod.load_pairs(data, Words(), 6)


def test_bench_dflash_anchors_trains_what_it_says(tmp_path):
    """bench_dflash_anchors.py: a DFlash run supervises as many first drafts a batch as it takes anchors (split over
    its rows), the 'all' run every trained position; each run reports held-out accuracy at the steps asked; the JSON
    holds the table."""
    mod = _load("bench_dflash_anchors")
    out = tmp_path / "r.json"
    res = mod.main(["--steps", "4", "--every", "2", "--anchors", "32,all", "--out", str(out)])
    runs = res["runs"]
    assert list(runs) == ["eagle3 (TTT 3)", "dflash, 32 anchors", f"dflash, {mod.ROWS * (mod.T - 4)} anchors"]
    assert runs["dflash, 32 anchors"]["first_drafts_per_batch"] == 32     # 2 in each of the 16 rows
    assert runs[f"dflash, {mod.ROWS * (mod.T - 4)} anchors"]["first_drafts_per_batch"] > 100
    for r in runs.values():
        assert [p["step"] for p in r["points"]] == [2, 4]
        assert all(0.0 <= p["first_draft_accuracy"] <= 1.0 and p["cpu_s"] > 0 for p in r["points"])
    assert json.loads(out.read_text())["runs"].keys() == runs.keys()


def test_bench_dflash_attention_compares_both_paths(tmp_path):
    """bench_dflash_attention.py --small: dense then flex at each anchor count (forward only on a CPU), the flex
    logits equal to the dense ones; the JSON holds the table."""
    import torch

    mod = _load("bench_dflash_attention")
    out = tmp_path / "r.json"
    res = mod.main(["--small", "--repeat", "1", "--out", str(out)])
    assert res["backward"] is torch.cuda.is_available() and res["length"] == 200
    assert [(r["anchors"], r["attention"]) for r in res["runs"]] == [(16, "dense"), (16, "flex"), (64, "dense"),
                                                                      (64, "flex")]
    for r in res["runs"]:
        assert r["ms"] > 0
        assert (r["max_abs_diff"] is None) == (r["attention"] == "dense")
        assert r["attention"] == "dense" or r["max_abs_diff"] < (5e-2 if res["dtype"] == "bfloat16" else 1e-4)
    assert json.loads(out.read_text())["runs"] == res["runs"]


def _sweep_point(C, drafter, k, tau, rate, speedup, identical, flag):
    return {"concurrency": C, "in_flight": C, "drafter": drafter, "kind": "x", "head": None, "k": k, "tau": tau,
            "tokens": 4096, "seconds": 4096 / rate, "tokens_per_s": rate, "speedup": speedup,
            "lossless": {"identical": identical, "total": 32},
            "serving": {"vllm_flag": flag, "sglang": None, "sglang_note": "none", "vllm_speculative_config": {}}}


def test_qwen_summary_reports_the_serving_sweep_and_a_sweep_cut_short(tmp_path):
    """The sweep's recommendation per concurrency goes into the summary and its Markdown with the exact vLLM flag;
    a sweep cut short (only sweep_partial.json beside the eval's report) is said to be so, with its points and no
    recommendation; no sweep is 'not run'."""
    mod = _load("qwen_summary")
    run = tmp_path / "run"
    ev = run / "eval_sweep_eagle3"
    ev.mkdir(parents=True)
    (run / "eval_eagle3_code_holdout").mkdir()
    report = json.loads((REPO / "benchmarks/results/smollm2_reference/eval_mixed/report.json").read_text())
    (run / "eval_eagle3_code_holdout" / "report.json").write_text(json.dumps(report))
    plain = [{"concurrency": 1, "in_flight": 1, "tokens": 4096, "seconds": 10.0, "tokens_per_s": 409.6},
             {"concurrency": 8, "in_flight": 8, "tokens": 4096, "seconds": 2.0, "tokens_per_s": 2048.0}]
    pts = [_sweep_point(1, "head", 3, 1.8, 491.5, 1.2, 31, "--speculative-config '{\"k\": 3}'"),
           _sweep_point(8, "head", 3, 1.7, 1843.2, 0.9, 32, "--speculative-config '{\"k\": 3}'")]
    plain_rec = {"concurrency": 8, "in_flight": 8, "drafter": "plain (no drafting)", "kind": "plain", "head": None,
                 "k": 0, "tau": 1.0, "tokens_per_s": 2048.0, "speedup": 1.0, "serving": {"vllm_flag": None}}
    sweep = {"conversations": 32, "max_new_tokens": 128, "plain": plain, "points": pts, "notes": ["n"],
             "recommendation": [dict(pts[0], plain_tokens_per_s=409.6), dict(plain_rec, plain_tokens_per_s=2048.0)],
             "best": pts}
    (ev / "report.json").write_text(json.dumps(dict(report, sweep=sweep,
                                                    settings=dict(report["settings"], dtype="torch.bfloat16"))))
    s = mod.summarize(run, None, None, {})
    sw = s["heads"]["eagle3"]["sweep"]
    assert sw["complete"] and sw["dtype"] == "torch.bfloat16" and sw["conversations"] == 32
    assert [(r["concurrency"], r["drafter"], r["k"]) for r in sw["recommendation"]] == [
        (1, "head", 3), (8, "plain (no drafting)", 0)]
    assert sw["recommendation"][0]["identical"] == 31 and sw["recommendation"][1]["total"] is None
    s["goals"] = mod.goals(s)
    md = mod.markdown(s)
    assert "the recommended configuration per concurrency:" in md
    assert "| 1 | head | 3 | 1.80 | 492 (410) | 1.20× | 31/32 | `--speculative-config '{\"k\": 3}'` |" in md
    assert "| 8 | plain (no drafting) | — | 1.00 | 2,048 (2,048) | 1.00× | — | no flag (plain) |" in md
    # cut short: the eval's report without its sweep, the points so far beside it
    (ev / "report.json").write_text(json.dumps(report))
    (ev / "sweep_partial.json").write_text(json.dumps({"created": "x", "settings": {"dtype": "torch.bfloat16"},
                                                       "complete": False, "plain": plain[:1], "points": pts[:1]}))
    sw = mod.summarize(run, None, None, {})["heads"]["eagle3"]["sweep"]
    assert not sw["complete"] and sw["recommendation"] == [] and len(sw["points"]) == 1
    assert sw["dtype"] == report["settings"]["dtype"]       # the eval's report names the dtype both ran in
    assert (sw["conversations"], sw["max_new_tokens"]) == (report["prompts"]["count"],
                                                           report["settings"]["max_new_tokens"])
    s2 = mod.summarize(run, None, None, {})
    s2["goals"] = mod.goals(s2)
    md = mod.markdown(s2)
    assert (f"continuous batching, {report['prompts']['count']} conversations of the held-out code set, "
            f"{report['settings']['max_new_tokens']} new tokens") in md
    assert "cut short, no recommendation; the points it measured:" in md
    assert "| 1 | head | 3 | 1.80 | 492 (410) | 1.20× | 31/32 |" in md
    (ev / "sweep_partial.json").unlink()
    (ev / "report.json").unlink()
    assert mod.summarize(run, None, None, {})["heads"]["eagle3"]["sweep"] == "not run"


def test_qwen_summary_lists_a_tagged_variant_beside_the_recipes_head(tmp_path):
    """gpu_qwen.sh TAG=lr1e-3 trains eagle3_lr1e-3 on the same rows: the summary lists it under that name with its
    kind, its evals and stage times its own; the recipe's head keeps its own evals and alone is judged."""
    mod = _load("qwen_summary")
    run = tmp_path / "run"
    report = json.loads((REPO / "benchmarks/results/smollm2_reference/eval_mixed/report.json").read_text())
    for d in ("eval_eagle3_mixed", "eval_eagle3_lr1e-3_mixed", "train_eagle3_lr1e-3", "train_eagle3_not_a_tag"):
        (run / d).mkdir(parents=True)
    (run / "eval_eagle3_mixed" / "report.json").write_text(json.dumps(report))
    tagged = json.loads(json.dumps(report))
    for r in tagged["runs"]:
        if r.get("name", "").startswith("head"):
            r["metrics"]["tau"] = 9.0
    (run / "eval_eagle3_lr1e-3_mixed" / "report.json").write_text(json.dumps(tagged))
    rows = [{"split": "train", "step": 10, "tokens_per_s": 30000.0, "loss": 5.0}]
    (run / "train_eagle3_lr1e-3" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [n for n, _ in mod.head_names(run)] == ["eagle3", "eagle3_lr1e-3", "peagle", "dflash"]
    timeline = tmp_path / "timeline.txt"
    timeline.write_text("[10:00:00] end train_eagle3_lr1e-3 rc=0 200s\n"
                        "[10:01:00] end eval_eagle3_lr1e-3_mixed rc=0 50s\n[10:02:00] end eval_eagle3_mixed rc=0 40s\n")
    fast = tmp_path / "bench_runtime_eagle3_lr1e-3.json"
    fast.write_text(json.dumps(_runtime([("compiled", 1, "plain", 1.0, 200.0, 1.0, True),
                                         ("compiled", 1, "head (eagle3)", 3.0, 600.0, 3.0, True)])))
    s = mod.summarize(run, timeline, None, {"eagle3_lr1e-3": fast})
    v, h = s["heads"]["eagle3_lr1e-3"], s["heads"]["eagle3"]
    assert v["kind"] == "eagle3" and v["training"]["steps"] == 10 and "kind" not in h
    assert v["evals"]["mixed"]["tau"] == 9.0 and h["evals"]["mixed"]["tau"] != 9.0
    assert v["time"]["stages"] == ["train_eagle3_lr1e-3", "eval_eagle3_lr1e-3_mixed"]
    assert h["time"]["stages"] == ["eval_eagle3_mixed"]
    s["goals"] = mod.goals(s)
    assert s["goals"]["eagle3_tau_k3_mixed>=2.6"]["value"] == h["evals"]["mixed"]["tau"]
    # the variant's runtime is listed, but a variant's 3.0x is no speed goal met by the recipe's heads
    assert s["goals"]["best_head_speedup_batch1>=2.5"] == "not run"
    md = mod.markdown(s)
    assert "| eagle3_lr1e-3 | mixed | " in md and "| eagle3_lr1e-3 | 1 | static | head (eagle3) | 3.00 |" in md


def test_summaries_say_whether_the_tree_matched_its_commit(tmp_path):
    """machine() (every summary's provenance) names the commit and whether a tracked file differed from it: a tree
    copied onto another machine can carry an older .git, whose HEAD alone would name the wrong code."""
    import subprocess

    mod = _load("reference_summary")
    repo = tmp_path / "r"
    repo.mkdir()
    git = ["git", "-c", "user.email=a@b", "-c", "user.name=a", "-C", str(repo)]
    subprocess.run(git + ["init", "-q"], check=True)
    (repo / "f.py").write_text("x = 1\n")
    subprocess.run(git + ["add", "f.py"], check=True)
    subprocess.run(git + ["commit", "-qm", "c"], check=True)
    cwd = os.getcwd()
    try:
        os.chdir(repo)
        clean = mod.machine()
        (repo / "f.py").write_text("x = 2\n")
        dirty = mod.machine()
    finally:
        os.chdir(cwd)
    assert clean["git_dirty"] is False and dirty["git_dirty"] is True
    assert clean["git_commit"] == dirty["git_commit"] and len(clean["git_commit"]) == 40
