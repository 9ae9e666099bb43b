"""``bt-hub demo``: the report and plots, honest baselines, and a user's files never touched."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch

from bt_hub import cli
from bt_hub.common.records import fmt_mean_std
from bt_hub.common.runs import RunDir, claim_run_dir

# 2 pretraining runs of 10 steps (batch 256), the curve at steps 5 and 10, a 10-epoch grid: what the report says;
# on the suite's torch threads (conftest.py), not the demo's 2, which beside a second xdist worker made 3 threads on
# 2 cores and spun (228 s of CPU for the demo on a loaded machine)
SHORT = [
    "--threads",
    "0",
    "--epochs",
    "2",
    "--batch-size",
    "256",
    "--pretrain-seeds",
    "2",
    "--curve-points",
    "2",
    "--linear-epochs",
    "10",
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROWS = ("step 10", "pixels", "random-init")
COLUMNS = ("kNN 10%", "kNN 100%", "linear 10%", "linear 100%")  # the default label budgets, 10% and 100%


@pytest.fixture(scope="module")
def short_demo(tmp_path_factory):
    """The shortened demo's folder; what it printed is kept beside it in ``printed.txt``."""
    out = tmp_path_factory.mktemp("demo") / "demo_out"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli.main(["demo", "--out", str(out), *SHORT]) == 0
    (out.parent / "printed.txt").write_text(printed.getvalue())
    return out


def test_the_demo_ends_with_its_headline_and_the_path_of_its_report(short_demo):
    """Guards: bt-hub demo ended silently, with no word of its result or of where report.md is."""
    printed = (short_demo.parent / "printed.txt").read_text().splitlines()
    assert printed[-1].startswith(f"wrote {short_demo / 'report.md'} (")
    assert printed[-6] == "at the last step (10):"
    for line, column in zip(printed[-5:-1], COLUMNS, strict=True):  # one verdict a budget, with its test
        assert line.startswith(f"  {column}: ") and " against " in line and " on 360 test images)" in line


def _per_seed(out: Path) -> dict[tuple[str, str], list[float]]:
    """(row, column) -> top-1 (RankMe in its column) of each seed, in seed order, from the comparison's per-seed
    records."""
    cells: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for line in (out / "compare" / "results.jsonl").read_text().splitlines():
        record = json.loads(line)
        where = record["notes"]["compare"]
        value = record["metrics"].get("top1", record["metrics"].get("rankme"))
        cells.setdefault((where["row"], where["column"]), []).append((record["seed"], value))
    return {cell: [v for _, v in sorted(values)] for cell, values in cells.items()}


def test_shortened_demo_leads_with_the_curve_over_pretraining_runs_and_writes_the_plots(short_demo):
    report = (short_demo / "report.md").read_text()
    assert report.index("## The answer at each label budget (step 10)") < report.index("## The learning curve")
    assert report.index("## The learning curve") < report.index("## At the last step (step 10)")
    assert "![curve](compare/curve.png)" in report and (short_demo / "compare" / "curve.png").stat().st_size > 5_000
    for name in ("loss.png", "cross_correlation.png"):
        assert (short_demo / name).read_bytes().startswith(PNG_MAGIC) and f"![{name}]({name})" in report
    results = json.loads((short_demo / "results.json").read_text())
    assert results["seeds"] == [0, 1] and results["last_step"] == "step 10"
    assert len(results["curve"]["crossings"]) == 8  # kNN and linear at 2 budgets, each against pixels and random-init
    assert all(f"- {line}" in report for line in results["curve"]["crossings"])
    for run in ("pretrain", "pretrain-seed1"):  # two pretraining runs, each keeping steps 5 and 10
        assert sorted(p.name for p in (short_demo / run / "kept").iterdir()) == [
            "step-000005.safetensors",
            "step-000010.safetensors",
        ]
    records = [json.loads(line) for line in (short_demo / "compare" / "results.jsonl").read_text().splitlines()]
    fingerprints = {
        (r["seed"], r["weights"]["fingerprint"]) for r in records if r["notes"]["compare"]["row"] == "step 10"
    }
    assert len(fingerprints) == 2  # run i, scored with seed i


def test_the_demo_answers_at_each_label_budget_with_the_verdicts_it_records(short_demo):
    # guards: the demo answered at full labels only, where the raw pixels are strongest (issue 48, item 4)
    results = json.loads((short_demo / "results.json").read_text())
    verdicts = results["verdicts"]["step 10"]
    assert list(verdicts) == [*COLUMNS]
    report = (short_demo / "report.md").read_text()
    section = report[report.index("## The answer at each label budget") : report.index("## The learning curve")]
    answers = [line for line in section.splitlines() if line.startswith("- ")]
    for line, column in zip(answers, COLUMNS, strict=True):
        verdict = verdicts[column]
        word = {True: "yes", False: "no", None: "no verdict"}[verdict["better"]]
        assert verdict["test_images"] == 360 and 0 < verdict["p_value"] <= 1 and verdict["baseline"] in ROWS[1:]
        assert line.startswith(f"- {column}: ") and f": {word} (" in line and f"vs {verdict['baseline']}, p " in line
    assert "Rule: " in section and "level 0.05" in section


def test_every_cell_of_the_report_is_the_mean_and_std_of_its_per_seed_records(short_demo):
    per_seed = _per_seed(short_demo)
    rows = {}
    for line in (short_demo / "report.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[0].removesuffix(" (baseline)") in ROWS:
            rows[cells[0].removesuffix(" (baseline)")] = cells[1:6]
    assert set(rows) == set(ROWS)
    for row, cells in rows.items():
        for column, cell in zip((*COLUMNS, "RankMe"), cells, strict=True):
            values = per_seed[(row, column)]
            assert len(values) == 2, (row, column)
            same = len(set(values)) == 1  # a cell without spread says why instead of "± 0.0"
            # the kNN vote of the pixels on all the labels is the same at every seed; runs that scored alike are not
            why = "deterministic" if (row, column) == ("pixels", "kNN 100%") else "2 seeds alike"
            assert cell == (f"{fmt_mean_std(values[:1])} ({why})" if same else fmt_mean_std(values))


def test_the_random_init_row_is_not_degenerate_on_the_digits(short_demo):
    # Guards: the random-init baseline was the zero-initialised residual network (18.3 linear on the digits).
    per_seed = _per_seed(short_demo)
    assert min(per_seed[("random-init", "linear 100%")]) >= 80.0
    assert min(per_seed[("random-init", "kNN 100%")]) >= 80.0


def test_bt_hub_eval_compare_reproduces_the_demos_per_seed_values(short_demo, tmp_path):
    demo = json.loads((short_demo / "results.json").read_text())["table"]
    argv = ["eval", "compare", "--weights", str(short_demo / "pretrain"), str(short_demo / "pretrain-seed1")]
    argv += ["--as-seeds", "--over-steps", "--baselines", "pixels,random-init", "--protocols", "knn,linear"]
    argv += ["--linear-epochs", "10", "--data", "digits", "--image-size", "8", "--test-split", "test"]
    assert cli.main([*argv, "--label-fractions", "10", "100", "--out", str(tmp_path / "compare")]) == 0
    table = json.loads((tmp_path / "compare" / "results.json").read_text())["table"]
    for row in ("step 5", *ROWS):
        for column in (*COLUMNS, "RankMe"):
            assert table[row][column]["per_seed"] == demo[row][column]["per_seed"], (row, column)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _refused(argv: list[str], capsys) -> str:
    """Run ``bt-hub`` expecting a refusal: exit 2 and one line on stderr, no traceback; that line."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


def test_demo_rejects_a_directory_it_did_not_write(tmp_path, capsys):
    (tmp_path / "pretrain").mkdir(parents=True)
    (tmp_path / "pretrain" / "notes.txt").write_text("mine")
    before = _snapshot(tmp_path)
    # the ownership rule of every command: a folder bt_hub did not create needs --overwrite
    assert "is not empty and was not created by bt-hub" in _refused(["demo", "--out", str(tmp_path), *SHORT], capsys)
    assert _snapshot(tmp_path) == before


def test_demo_never_deletes_a_pretraining_run_at_out_pretrain(tmp_path, capsys):
    # Guards: the demo removed OUT/pretrain whenever it held a run.json, a user's pretraining run and files included.
    out = claim_run_dir(tmp_path / "runs", kind="demo")  # an earlier demo, as `bt-hub demo --out runs` finds it
    with RunDir(out / "pretrain", {"projector": "128-128-32", "lr_weights": 8.0}, kind="pretrain") as run:
        (run.path / "backbone.safetensors").write_bytes(b"weights of a long run")
        (run.path / "notes.txt").write_text("mine")
    before = _snapshot(tmp_path)
    err = _refused(["demo", "--out", str(out), *SHORT], capsys)
    assert "--overwrite" in err and "new --out" in err and "pretrain" in err
    assert _snapshot(tmp_path) == before


def test_demo_never_replaces_a_users_report_in_a_bt_hub_folder(tmp_path, capsys):
    # Guards: the demo wrote report.md and results.json into any folder carrying bt_hub's marker, exit 0.
    out = claim_run_dir(tmp_path / "out", kind="demo")
    (out / "report.md").write_text("# my report")
    (out / "results.json").write_text('{"mine": 1}')
    before = _snapshot(tmp_path)
    err = _refused(["demo", "--out", str(out), *SHORT], capsys)
    assert "--overwrite" in err and "new --out" in err and "report.md" in err
    assert _snapshot(tmp_path) == before


def test_a_demo_of_other_settings_into_the_same_out_is_refused_and_keeps_the_first_ones_files(short_demo, capsys):
    before = _snapshot(short_demo)
    err = _refused(["demo", "--out", str(short_demo), *SHORT, "--curve-points", "3"], capsys)
    assert "holds a demo run of other settings: recipe changed (curve_points);" in err
    assert "--overwrite" in err and "new --out" in err
    assert _snapshot(short_demo) == before


def test_demo_with_overwrite_claims_a_used_folder_and_keeps_its_other_files(tmp_path):
    from bt_hub.eval import demo

    (tmp_path / "notes.txt").write_text("mine")
    with demo._claimed_out(demo.DemoConfig(out=str(tmp_path), overwrite=True)) as (out, continues):
        assert out == tmp_path and not continues
        assert (tmp_path / "notes.txt").read_text() == "mine"
        assert (tmp_path / ".bt_hub_run").is_file()


# a demo of 4 steps of batch 32 (one run, its curve at step 4), cut by Ctrl-C after its second step
TINY = ["--epochs", "1", "--batch-size", "32", "--max-steps", "4", "--pretrain-seeds", "1", "--curve-points", "1"]
TINY += ["--linear-epochs", "2"]


def _one_line(err: str) -> str:
    """The last line a command wrote on stderr (its one sentence; progress lines come before it)."""
    return err.strip().splitlines()[-1]


def test_the_demo_run_again_after_ctrl_c_continues_each_pretraining_run_from_its_checkpoint(
    tmp_path, monkeypatch, capsys
):
    # guards: after Ctrl-C the demo said "run the same command again to continue", which was refused (--out holds
    # pretrain ...; pass --overwrite), and with --overwrite it pretrained again from step 0 (issue 46, case 9)
    import contextlib as ctx
    import signal

    from safetensors.torch import load_file

    from bt_hub.common.config import torch_threads
    from bt_hub.train import pretrain as loop
    from bt_hub.train.config import PretrainConfig

    @ctx.contextmanager
    def ctrl_c_after_two_steps(device):
        steps = iter(range(1, 100))
        yield lambda: signal.SIGINT if next(steps) == 2 else 0

    out, argv = tmp_path / "demo", ["demo", "--out", str(tmp_path / "demo"), *TINY]
    monkeypatch.setattr(loop, "deferred_stop", ctrl_c_after_two_steps)
    assert cli.main(argv) == 130
    said = _one_line(capsys.readouterr().err)
    assert said.endswith(f"run the same command again to continue: bt-hub {' '.join(argv)}"), said
    monkeypatch.undo()
    assert cli.main(argv) == 0  # the same command
    run = json.loads((out / "pretrain" / "run.json").read_text())
    assert [r["resumed_from_step"] for r in run["resumes"]] == [2]  # continued from the checkpoint of step 2
    assert json.loads((out / "results.json").read_text())["last_step"] == "step 4"
    # an uninterrupted run of the recipe the demo recorded: the same last metrics and weights, bit for bit
    recipe = {k: v for k, v in run["config"].items() if k in {f.name for f in dataclasses.fields(PretrainConfig)}}
    with torch_threads(2):  # the demo's threads
        runs = [out / "pretrain", loop.pretrain(PretrainConfig(**{**recipe, "out": str(tmp_path / "ref")}))]
    keys = ("step", "loss", "invariance", "redundancy", "embedding_std", "lr_weights")
    ours, theirs = ({k: json.loads((p / "metrics.jsonl").read_text().splitlines()[-1])[k] for k in keys} for p in runs)
    assert ours == theirs and ours["step"] == 4
    weights = [load_file(p / "backbone.safetensors") for p in runs]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[1])


def test_an_interrupted_demo_names_the_command_that_continues_it_and_refuses_other_settings(
    tmp_path, monkeypatch, capsys
):
    # guards: a demo started with --overwrite and cut by Ctrl-C named the --overwrite command, which starts over
    from bt_hub.data import measured, precision
    from bt_hub.eval import demo

    monkeypatch.setattr(measured, "cache_file", lambda name: tmp_path / "precision.json")
    monkeypatch.setattr(precision, "measure_cpu", lambda: {"fp32": 0.1, "bf16": 10.0})
    resumed = []
    monkeypatch.setattr(
        demo, "pretrain", lambda c: resumed.append(c.resume) or (_ for _ in ()).throw(KeyboardInterrupt)
    )
    out, tiny = tmp_path / "demo", ["--epochs", "1", "--max-steps", "2"]
    assert cli.main(["demo", "--out", str(out), "--overwrite", *tiny]) == 130
    said = _one_line(capsys.readouterr().err)
    assert said.endswith(
        f"run the command again without --overwrite to continue: bt-hub demo --out {out} {' '.join(tiny)}"
    )
    assert cli.main(["demo", "--out", str(out), *tiny]) == 130  # that command continues the demo's run
    assert _one_line(capsys.readouterr().err).endswith(
        f"run the same command again to continue: bt-hub demo --out {out} {' '.join(tiny)}"
    )
    assert resumed == [None, "auto"]  # the first pretraining run started afresh, then resumed from its checkpoint
    before = _snapshot(out)
    err = _refused(["demo", "--out", str(out), "--epochs", "2", "--max-steps", "2"], capsys)
    assert f"--out {out} holds a demo run of other settings: recipe changed (pretrain.epochs);" in err
    assert "choose a new --out, or pass --overwrite to start that demo over" in err and _snapshot(out) == before
    # a refusal after the claim (pretraining's schedule check) takes it back whole: no run.json of the refused
    # settings is left to refuse the corrected command as "other settings"
    monkeypatch.setattr(demo, "pretrain", lambda c: (_ for _ in ()).throw(ValueError("--max-steps 9 is too many")))
    assert cli.main(["demo", "--out", str(tmp_path / "new"), *tiny]) == 2 and not (tmp_path / "new").exists()


@pytest.mark.slow
def test_demo_is_deterministic_for_a_seed(tmp_path):
    tiny = ["--epochs", "1", "--max-steps", "2", "--pretrain-seeds", "2", "--curve-points", "1", "--linear-epochs", "2"]
    tables = []
    for run in ("a", "b"):
        assert cli.main(["demo", "--out", str(tmp_path / run), *tiny]) == 0
        tables.append(json.loads((tmp_path / run / "results.json").read_text())["table"])
    assert tables[0] == tables[1]


def test_the_demo_pretrains_with_the_digits_preset_of_bt_hub_pretrain(tmp_path, monkeypatch):
    # Guards: the demo and `bt-hub pretrain --preset digits` carried two different digits recipes.
    from bt_hub.eval import demo
    from bt_hub.train.pretrain import PretrainConfig

    seen = {}

    def capture(config):
        seen["config"] = config
        return tmp_path

    monkeypatch.setattr(demo, "pretrain", capture)
    demo._pretrain(demo.DemoConfig(out=str(tmp_path / "d")), tmp_path / "d" / "pretrain", 0, [22, 88])
    for key, value in PretrainConfig.PRESETS["digits"].items():
        assert getattr(seen["config"], key) == value, key
    assert seen["config"].keep_every == "22,88"


def test_the_demo_says_at_its_start_how_long_it_takes_here_from_the_step_it_measured(tmp_path, monkeypatch, capsys):
    # Guards: the README promised about 5 minutes on 2 cores (an AVX-512 EPYC, bf16); on an AVX2-only EPYC (fp32)
    # the demo took 17, and said nothing of it before it ended.
    from bt_hub.data import measured, precision
    from bt_hub.eval import demo

    monkeypatch.setattr(measured, "cache_file", lambda name: tmp_path / "precision.json")
    monkeypatch.setattr(demo, "pretrain", lambda config: (_ for _ in ()).throw(KeyboardInterrupt))
    said = []
    for run, fp32 in enumerate((0.3, 0.1)):
        (tmp_path / "precision.json").unlink(missing_ok=True)
        monkeypatch.setattr(precision, "measure_cpu", lambda fp32=fp32: {"fp32": fp32, "bf16": 10.0})
        assert cli.main(["demo", "--out", str(tmp_path / str(run))]) == 130
        first, demo_line = capsys.readouterr().err.splitlines()[:2]  # measured anew: the timing is announced first
        assert first.startswith("timing bf16 against fp32 on this CPU once")
        said.append(demo_line)
    # 2 runs x 200 steps x 8 x the step (2 x 256 digits of 8 px through the 3x3 stem against 16 images of 64 px
    # through the 7x7/2 stem and max-pool), and 6% more for scoring
    assert said == [
        f"bt-hub demo: about {minutes} minutes on this machine (2 pretraining runs of 200 steps, then scoring), from "
        f"--precision auto's ResNet-18 step of {fp32} s in fp32 here"
        for minutes, fp32 in ((17, 0.3), (6, 0.1))
    ]
