"""eval/compare.py renders the side-by-side report from tiny runs; bad comparisons fail clearly."""

import json
import re
import shutil

import matplotlib.image
import pytest

from conftest import load_script  # tests/ is on sys.path under pytest

compare = load_script("eval/compare.py")
BENCH = "tests/data/tiny_prompts.jsonl"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "eagle3_tiny"
    load_script("train/eagle.py").main(["recipes/eagle3_tiny.yaml", f"output_dir={out}", "max_steps=4",
                                        "save_every=0", "eval_every=0"])
    return out / "checkpoint-final"


def run_compare(out, *drafters, target="tiny-random-llama", extra=()):
    return compare.main(["--target", target, "--drafters", *map(str, drafters), "--baselines", "prompt-lookup",
                         "--bench", BENCH, "--temperature", "0,1", "--tree", "chain:3", "--sweep", "chain:1",
                         "--sweep", "dynamic:total=6,depth=3,topk=2", "--limit", "2", "--max-new-tokens", "12",
                         "--threads", "1", "--out", str(out), *extra])


@pytest.fixture(scope="module")
def report(checkpoint, tmp_path_factory):
    # one comparison (2 drafters x 2 temperatures x 3 trees), shared by the tests that read it
    out = tmp_path_factory.mktemp("compare") / "report"
    return run_compare(out, checkpoint), out


@pytest.mark.slow
def test_report_renders_with_one_row_per_run_and_decodable_plots(report):
    index, out = report
    text = index.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| eagle3:") or line.startswith("| prompt-")]
    main_rows = [r for r in rows if r.count("|") == 10]
    assert len(main_rows) == 2 * 2  # 2 drafters x 1 bench x 2 temperatures
    runs = sorted((out / "runs").glob("*.json"))
    assert len(runs) == 2 * (2 + 2)  # + 2 sweep trees per drafter
    # every table row's tau is the tau of the JSON it came from
    by_label = {}
    for path in runs:
        report = json.loads(path.read_text())
        if report["tree"] == "chain:3":
            label = "prompt-lookup" if report["proposer"] == "prompt-lookup" else "eagle3:eagle3_tiny"
            by_label[(label, report["sampling"]["temperature"])] = report["tau"]
    for row in main_rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[5]) == pytest.approx(by_label[(cells[0], float(cells[3]))], abs=5e-4)
    assert "4 steps" in text  # the training budget read from the checkpoint
    images = re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)
    assert sorted(images) == sorted(["tau_by_category-tiny_prompts-t0.png", "tau_by_category-tiny_prompts-t1.png",
                                     "acceptance_by_depth-tiny_prompts-t0.png",
                                     "acceptance_by_depth-tiny_prompts-t1.png",
                                     "speedup_vs_budget.png", "training_curves.png"])
    for name in images:
        pixels = matplotlib.image.imread(out / name)
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100 and pixels.std() > 0  # drawn, not blank


def test_a_repeated_comparison_reuses_its_runs(report, checkpoint, capsys):
    index, out = report
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (out / "runs").glob("*.json")}
    capsys.readouterr()
    run_compare(out, checkpoint)
    assert capsys.readouterr().out.count("compare: reusing") == 2 * 4
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (out / "runs").glob("*.json")} == before


def test_drafters_for_different_targets_are_refused(checkpoint, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    meta = json.loads((other / "drafter.json").read_text())
    meta["target"]["num_layers"] += 1
    (other / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(SystemExit, match="different targets.*num_layers"):
        run_compare(tmp_path / "report", checkpoint, other)
    assert not (tmp_path / "report").exists()  # refused before anything ran


def test_wrong_target_and_non_checkpoints_are_refused(checkpoint, tmp_path):
    with pytest.raises(SystemExit, match="not --target 'tiny-random-gemma3'"):
        run_compare(tmp_path / "report", checkpoint, target="tiny-random-gemma3")
    with pytest.raises(SystemExit, match="not a drafter checkpoint"):
        run_compare(tmp_path / "report", tmp_path)


def test_a_drafter_can_run_at_its_own_tree(checkpoint, tmp_path):
    index = compare.main(["--target", "tiny-random-llama", "--drafters", str(checkpoint), f"{checkpoint}@chain:1",
                          "--bench", BENCH, "--tree", "chain:3", "--limit", "1", "--max-new-tokens", "8",
                          "--threads", "1", "--no-speed", "--out", str(tmp_path / "r")])
    rows = [line for line in index.read_text().splitlines() if line.startswith("| eagle3:")]
    assert len(rows) == 2
    assert "`chain:3` (3)" in rows[0] and rows[1].startswith("| eagle3:eagle3_tiny @chain:1 |") and "`chain:1` (1)" in rows[1]


def test_a_tree_a_drafter_cannot_draft_is_refused_before_anything_runs(tmp_path):
    heads = tmp_path / "medusa"  # 3 heads: depth <= 3
    load_script("train/heads.py").main(["recipes/medusa_tiny.yaml", f"output_dir={heads}", "max_steps=2",
                                        "save_every=0", "eval_every=0"])
    with pytest.raises(SystemExit, match=r"medusa:medusa cannot run tree 'chain:5'.*@TREE"):
        compare.main(["--target", "tiny-random-llama", "--drafters", str(heads / "checkpoint-final"),
                      "--bench", BENCH, "--tree", "chain:2", "--sweep", "chain:5", "--out", str(tmp_path / "r")])
    assert not (tmp_path / "r").exists()


def test_engine_rows_join_the_report_and_another_targets_are_refused(tmp_path):
    # an eval/llama_cpp.py --json report (its schema, with two modes) joins the table as llama.cpp measured it
    row = {"mode": "plain", "n_max": None, "tokens_per_s": 96.1, "speedup": 1.0, "acceptance": None, "accepted": 0,
           "drafted": 0, "tau": 1.0}
    eagle = {**row, "mode": "eagle3 ckpt x3", "n_max": 3, "tokens_per_s": 23.6, "speedup": 0.25, "acceptance": 0.05,
             "accepted": 8, "drafted": 153, "tau": 1.14}
    report = {"target": "tiny-random-llama", "weights": "f32", "rows": [row, eagle],
              "referee": {"eagle3 ckpt x3": {"ours_accepted": 3, "engine_accepted": 3}}}
    (tmp_path / "engine.json").write_text(json.dumps(report))
    index = compare.main(["--target", "tiny-random-llama", "--engine", str(tmp_path / "engine.json"),
                          "--out", str(tmp_path / "report")])
    text = index.read_text()
    assert "| f32 | eagle3 ckpt x3 | 3 | 23.6 | 0.25x | 8 / 153 | 1.14 | 3 / 3 |" in text
    assert "| f32 | plain | - | 96.1 | 1.00x | - | 1.00 | - |" in text
    (tmp_path / "other.json").write_text(json.dumps({**report, "target": "smollm2-135m-instruct"}))
    with pytest.raises(SystemExit, match="measured on 'smollm2-135m-instruct'"):
        compare.main(["--target", "tiny-random-llama", "--engine", str(tmp_path / "other.json"),
                      "--out", str(tmp_path / "report2")])


def test_broken_drafters_are_failed_rows_and_the_others_are_still_reported(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    nan, truncated, corrupt = (tmp_path / name for name in ("nan", "truncated", "corrupt"))
    for copy in (nan, truncated, corrupt):
        shutil.copytree(checkpoint, copy)
    tensors = load_file(nan / "model.safetensors")
    tensors["fc.weight"][0, 0] = float("nan")
    save_file(tensors, nan / "model.safetensors", metadata={"format": "pt"})
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    (corrupt / "drafter.json").write_text('{"family": "eagle3", "conf')
    out = tmp_path / "report"
    with pytest.raises(SystemExit, match="3 of 4 drafters could not be measured"):
        compare.main(["--target", "tiny-random-llama", "--drafters", str(checkpoint), str(nan), str(truncated),
                      str(corrupt), "--bench", BENCH, "--tree", "chain:2", "--limit", "1", "--max-new-tokens", "8",
                      "--threads", "1", "--no-speed", "--out", str(out)])
    text = (out / "index.md").read_text()
    assert sum(line.startswith("| eagle3:eagle3_tiny ") for line in text.splitlines()) == 1  # the healthy one
    not_measured = text.split("## Not measured")[1]
    assert "non-finite weights (NaN or inf) in fc.weight" in not_measured
    assert "cannot be read" in not_measured and "truncated or corrupt" in not_measured
    assert f"{corrupt / 'drafter.json'}: not a readable drafter record" in not_measured
    assert "give it a tree" not in text.lower()


def test_a_drafter_trained_on_other_weights_is_warned_in_the_report(tmp_path):
    # the warning that a drafter was trained on another model of --target's shape (here the same model with a LoRA
    # merged into one decoder layer) reached the console only: index.md reported its tau as the drafter's own
    from test_export import save_eagle3
    from test_faults_eval import merged_lora_target

    from drafters.targets import load_target

    checkpoint = save_eagle3(tmp_path / "eagle3_run" / "checkpoint-final", load_target("tiny-random-llama"))
    lora = merged_lora_target()
    lora.model.save_pretrained(tmp_path / "lora")
    lora.tokenizer.save_pretrained(tmp_path / "lora")

    def report(target, out):
        index = compare.main(["--target", target, "--drafters", str(checkpoint), "--bench", BENCH, "--tree", "chain:1",
                              "--limit", "1", "--max-new-tokens", "4", "--threads", "1", "--no-speed",
                              "--out", str(tmp_path / out)])
        return index.read_text()

    text = report(str(tmp_path / "lora"), "other")
    warning = re.search(r"^- \*\*warning\*\*: eagle3:eagle3_run was trained on target 'tiny-random-llama' with other "
                        rf"weights than '{re.escape(str(tmp_path / 'lora'))}' \(weights fingerprint [0-9a-f]{{16}} vs "
                        r"[0-9a-f]{16}\): the same shape, another model .*merged LoRA.*; its drafts are for that one; "
                        r"tau measured here is not that drafter's on its own target$", text, re.MULTILINE)
    assert warning and text.index(warning.group(0)) < text.index("## Results")
    assert "warning" not in report("tiny-random-llama", "own")  # its own target: nothing said
