"""The benchmark scripts' command lines on tiny shapes (nothing here is timed)."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

from benchmarks import train_step  # noqa: E402
from benchmarks.common import backend_variable_kept  # noqa: E402


def test_train_step_leaves_the_backend_variable_as_it_found_it(monkeypatch, capsys):
    """Each backend is picked through HF_SPANATTN_BACKEND; the script used to leave the last one set."""
    monkeypatch.delenv("HF_SPANATTN_BACKEND", raising=False)
    train_step.main(["--peak", "score:1000 [tiles]", "--seq", "8", "--batch", "1"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["peak"] >= 0
    assert "HF_SPANATTN_BACKEND" not in os.environ


@pytest.mark.parametrize("chosen", [None, "fused"])
def test_the_backend_variable_is_restored_after_an_error_too(chosen, monkeypatch):
    if chosen is None:
        monkeypatch.delenv("HF_SPANATTN_BACKEND", raising=False)
    else:
        monkeypatch.setenv("HF_SPANATTN_BACKEND", chosen)
    with pytest.raises(RuntimeError), backend_variable_kept():
        os.environ["HF_SPANATTN_BACKEND"] = "tiles"
        raise RuntimeError
    assert os.environ.get("HF_SPANATTN_BACKEND") == chosen


DATA = Path(__file__).parents[2] / "shared" / "data"
RULE_CHECK = ["--data", str(DATA), "--chars", "30000", "--seq", "32", "--dim", "16", "--heads", "2", "--layers", "1",
              "--batch", "2", "--warm", "0", "--backends", "tiles"]


@pytest.mark.parametrize("module,argv,message", [
    ("rule_check", ["--seq", "0"], "argument --seq: '0': expected an integer >= 1"),  # was: ZeroDivisionError
    ("rule_check", ["--race", "1", "--every", "0"], "argument --every: '0': expected an integer >= 1"),  # likewise
    ("rule_check", ["--batch", "0"], "argument --batch: '0': expected an integer >= 1"),  # was: a reshape error
    ("rule_check", ["--chars", "0"], "argument --chars: '0': expected an integer >= 1"),  # was: read as 2 M chars
    ("rule_check", ["--warm", "-1"], "argument --warm: '-1': expected an integer >= 0"),  # was: none, said -1
    ("rule_check", ["--seconds", "nan"], "argument --seconds: 'nan': expected a number >= 0"),  # was: no time limit
    ("rule_check", ["--chars", "10"], "--chars 10: 0 rows of --seq 32 tokens; --batch 2 needs more"),  # was: random_
    ("rule_check", ["--data", "{tmp}/none"], "--data {tmp}/none: no gpt2-tokenizer folder in it"),  # was: a Hub repo id
    ("rule_check", ["--dim", "10", "--heads", "4"], "--dim 10: expected a multiple of --heads 4"),  # was: GPT-2's
    ("rule_check", ["--data", "{tmp}/text"], "--data {tmp}/text: no wikitext-2-v1/train.txt in it"),  # a traceback
    ("rule_check", ["--data", "{tmp}/text", "--race", "1"], "--data {tmp}/text: no wikitext-2-v1/train.txt in it"),
    ("train_step", ["--peak", "score:1000", "--seq", "0"], "argument --seq: '0': expected an integer >= 1"),
    ("train_step", ["--peak", "score:1000", "--batch", "0"], "argument --batch: '0': expected an integer >= 1"),
    ("attention", ["--memory", "--seq", "16", "0"], "argument --seq: '0': expected an integer >= 1"),  # ZeroDivision
    ("attention", ["--memory", "--tokens", "0"], "argument --tokens: '0': expected an integer >= 1"),  # was: B = 1
    ("attention", ["--memory", "--tokens", "-5"], "argument --tokens: '-5': expected an integer >= 1"),  # likewise
    ("profile_attention", ["--device", "cpu", "--calls", "0"], "argument --calls: '0': expected an integer >= 1"),
    ("profile_attention", ["--device", "cpu", "--dim", "x"], "argument --dim: 'x': expected an integer >= 1"),
    # was: ZeroDivisionError (1), the row "every 10" timed without a recorded step (5), or with 1 in 14 (15)
    *(("diagnostics", ["--steps", n], f"argument --steps: '{n}': expected 1 + a multiple of 10 (11, 21, 31, ...)")
      for n in ("1", "5", "15")),
    ("profile_attention", ["--device", "cpu", "--seq", "-1"], "argument --seq: '-1': expected an integer >= 1"),
    # was: names cut to all their characters but the last
    ("profile_attention", ["--device", "cpu", "--width", "0"], "argument --width: '0': expected an integer >= 1"),
    # was: torch's "Trying to create tensor with negative dimension", or "Torch not compiled with CUDA enabled"
    ("attention", ["--memory", "--device", "cuda"], "argument --device: 'cuda': torch sees no CUDA device here"),
    ("train_step", ["--device", "cuda"], "argument --device: 'cuda': torch sees no CUDA device here"),
    ("profile_attention", ["--device", "cuda"], "argument --device: 'cuda': torch sees no CUDA device here"),
    ("rule_check", ["--device", "cuda"], "argument --device: 'cuda': torch sees no CUDA device here"),
    # labels and backends named before any run (were: after the warm-up steps or the runs of the ones before)
    ("rule_check", ["--rule", "bogus"], "argument --rule: label='bogus': expected '<method>:<alphas>"),
    ("rule_check", ["--backends", "tiles,bogus"], "--backends 'tiles,bogus': 'bogus': allowed are auto, tiles"),
    ("attention", ["--memory", "--methods", "score:1000", "Score:1"], "argument --methods: label='Score:1'"),
    ("train_step", ["--methods", "score:10"], "argument --methods: label='score:10': alphas=(1.0, 0.0): expected 4"),
    ("diagnostics", ["--span", "simple:10@per_block"],
     "argument --span: label='simple:10@per_block': score_grad='per_block'"),
    ("profile_attention", ["--device", "cpu", "--labels", "score:1000", "x"], "argument --labels: label='x'"),
    ("profile_attention", ["--device", "cpu", "--backends", "Tiles"], "argument --backends: invalid choice: 'Tiles'"),
    # was: SDPA's "flash attention: Currently do not support dropout > 0" (NaN), torch's dropout error (-1, 2)
    *(("train_step", ["--attn-dropout", value], f"argument --attn-dropout: '{value}': expected a number")
      for value in ("nan", "-1", "2", "1e308")),
])
def test_benchmark_options_out_of_range_are_named_before_anything_runs(module, argv, message, tmp_path, monkeypatch,
                                                                       capsys):
    if module == "rule_check" and not (DATA / "gpt2-tokenizer").is_dir():
        pytest.skip("needs ../shared/data")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in (RULE_CHECK if module == "rule_check" else []) + argv]
    if module == "rule_check":  # {tmp}/text: a data folder with the tokenizer alone
        (tmp_path / "text").mkdir()
        (tmp_path / "text" / "gpt2-tokenizer").symlink_to(DATA / "gpt2-tokenizer")
    main = importlib.import_module(f"benchmarks.{module}").main
    monkeypatch.setattr(sys, "argv", [module, *argv])  # for the scripts whose main reads sys.argv
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine's, whatever it has
    with pytest.raises(SystemExit) as err:
        main(argv) if "argv" in inspect.signature(main).parameters else main()
    assert err.value.code == 2 and message.replace("{tmp}", str(tmp_path)) in capsys.readouterr().err


def test_versions_compares_copies_of_the_package_in_one_process(tmp_path, capsys):
    """Two copies of this package's source: a row per (T, method) with the ratio of the second to the first,
    and this process's own package left in place."""
    import shutil
    import sys

    import hf_spanattn
    from benchmarks import versions

    package = Path(__file__).resolve().parents[1] / "src" / "hf_spanattn"
    for name in ("old", "new"):
        shutil.copytree(package, tmp_path / name / "src" / "hf_spanattn")
    versions.main([str(tmp_path / "old"), str(tmp_path / "new"), "--tokens", "32", "--seq", "8", "16",
                   "--methods", "score:1000", "standard:QKV101", "--repeats", "2"])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [(row[1].strip(), row[2].strip()) for row in rows] == [
        ("8", "score:1000"), ("8", "standard:QKV101"), ("16", "score:1000"), ("16", "standard:QKV101")]
    assert all(float(row[4]) > 0 for row in rows)
    assert sys.modules["hf_spanattn"] is hf_spanattn
