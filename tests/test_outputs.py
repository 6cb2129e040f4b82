"""Every output is checked before the work that fills it (issue 38, fault 10): a folder that is a file, or a file
path that is a directory, is refused in one sentence naming the path, and nothing expensive has run. (These two
cases fail for root too, unlike a read-only mode bit.)"""

import json

import pytest
from conftest import ROOT, load_script

from drafters import targets
from drafters.files import OutputError, check_writable


@pytest.fixture
def blocked(tmp_path):
    """(a file where a folder is needed, a directory where a file is needed)"""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    a_dir = tmp_path / "a-dir"
    a_dir.mkdir()
    return a_file, a_dir


@pytest.fixture
def no_target(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the output was checked")
    monkeypatch.setattr(targets, "load_target", refuse)


def test_check_writable_names_the_path_and_the_problem(blocked, tmp_path):
    a_file, a_dir = blocked
    with pytest.raises(OutputError, match=rf"--json {a_dir} is a directory; give a file path"):
        check_writable(a_dir, "--json", directory=False)
    with pytest.raises(OutputError, match=rf"--out {a_file}/run cannot be written \(Not a directory: {a_file} is a "
                                          r"file\)"):
        check_writable(a_file / "run", "--out", directory=True)
    assert check_writable(tmp_path / "new" / "out.json", "--json", directory=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-dir", "a-file"]  # nothing created, no probe file left


def test_training_output_dir_is_checked_before_the_target_loads(blocked, no_target):
    eagle = load_script("train/eagle.py")
    with pytest.raises(OutputError, match=r"output_dir= .*a-file/run cannot be written"):
        eagle.main([str(ROOT / "recipes/eagle3_tiny.yaml"), f"output_dir={blocked[0]}/run"])


def test_features_dir_is_checked_before_the_target_loads(blocked, no_target):
    features = load_script("train/features.py")
    with pytest.raises(OutputError, match=r"features.dir= .*a-file/store cannot be written"):
        features.main([str(ROOT / "recipes/eagle3_tiny.yaml"), f"features.dir={blocked[0]}/store"])


def test_regeneration_output_is_checked_before_the_target_loads(blocked, no_target):
    regenerate = load_script("train/regenerate.py")
    with pytest.raises(OutputError, match=r"output= .*a-dir is a directory"):
        regenerate.main([str(ROOT / "recipes/tiny_regenerate.yaml"), f"data={ROOT}/tests/data/tiny_prompts.jsonl",
                         f"output={blocked[1]}"])


def test_regeneration_report_is_checked_before_the_target_loads(blocked, no_target, tmp_path):
    # it was written after every row: an unwritable report= was a traceback once hours of rows were done
    regenerate = load_script("train/regenerate.py")
    with pytest.raises(OutputError, match=r"report= .*a-file/report.json cannot be written"):
        regenerate.main([str(ROOT / "recipes/tiny_regenerate.yaml"), f"data={ROOT}/tests/data/tiny_prompts.jsonl",
                         f"output={tmp_path / 'rows.jsonl'}", f"report={blocked[0]}/report.json"])
    assert not (tmp_path / "rows.jsonl").exists()


def test_tau_json_is_checked_before_the_target_loads(blocked, no_target, tmp_path):
    bench = tmp_path / "prompts.jsonl"
    bench.write_text(json.dumps({"prompt": "hi"}) + "\n")
    tau = load_script("eval/tau.py")
    with pytest.raises(SystemExit, match=r"--json .*a-dir is a directory"):
        tau.main(["--target", "tiny-random-llama", "--proposer", "prompt-lookup", "--bench", str(bench),
                  "--json", str(blocked[1])])


def test_compare_out_is_checked_before_anything_is_measured(blocked, no_target):
    compare = load_script("eval/compare.py")
    with pytest.raises(SystemExit, match=r"compare: --out .*a-file/report cannot be written"):
        compare.main(["--target", "tiny-random-llama", "--baselines", "prompt-lookup", "--bench", "mt_bench",
                      "--out", f"{blocked[0]}/report"])


def test_export_out_is_checked_before_anything_is_written(blocked, tmp_path, capsys):
    from test_export import save_eagle3

    checkpoint = tmp_path / "checkpoint"
    save_eagle3(checkpoint, targets.load_target("tiny-random-llama"))
    export = load_script("eval/export.py")
    assert export.main([str(checkpoint), "--format", "sglang", "--out", f"{blocked[0]}/out/export"]) == 1
    assert "a-file/out cannot be written" in capsys.readouterr().err


def test_llama_cpp_json_is_checked_before_a_server_starts(blocked, no_target, capsys):
    script = load_script("eval/llama_cpp.py")
    assert script.main(["--target", "tiny-random-llama", "--json", str(blocked[1])]) == 1
    assert "--json" in capsys.readouterr().err
