"""Every code block of the README runs as written, in the order a reader meets them.

The README names Hub models and datasets and the users' own files, as users will run it; here
`SUBSTITUTIONS` swaps each for a local stand-in (tiny models of the same families saved to folders,
with the GPT-2 tokenizer from `../shared/data`; a few hundred short lines of WikiText-2 from there
as text, JSON lines and CSV), and nothing else in a block is changed. Uploads go to a stand-in for
the Hub's API. Python blocks run in one namespace, like a notebook; shell blocks run command by
command in bash, in the same folder. Three rules say what does not run as written, each narrow and
named:
  - `pip install` commands are checked as already done (the package from this checkout, its
    extras and the named packages importable), not run;
  - `recipes/run_clm.py` runs with `TINY_RUN` appended (its later flags win), so that a recipe
    command trains a few steps on a few blocks;
  - `SKIPPED` names every other command that does not run here, and why.
A block that fails fails the test with its README line number."""

from __future__ import annotations

import csv
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from models import route_hub

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DATA = ROOT.parent / "shared" / "data"  # beside the clone, as on CI
RUN = {"python", "bash"}
SHOWN = {"text", "bibtex"}  # code blocks that are shown, not run

# Hub names and users' files (as the README writes them) -> local stand-ins; {fields} are filled by `world`.
SUBSTITUTIONS = {
    "distilbert/distilgpt2": "{gpt2}",
    "HuggingFaceTB/SmolLM2-135M": "{llama}",
    'load_dataset("wikitext", "wikitext-2-raw-v1", ': 'load_dataset("text", data_files={{"train": "{train}"}}, ',
    "--dataset_name wikitext --dataset_config_name wikitext-2-raw-v1": "--train_file {train} --validation_file "
                                                                        "{validation}",
    "my_train.jsonl": "{train_jsonl}",
    "my_validation.csv": "{validation_csv}",
}
TINY_RUN = ["--block_size", "32", "--max_train_samples", "8", "--max_eval_samples", "4", "--max_steps", "2",
            "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
            "--gradient_accumulation_steps", "1"]
# command (or the start of one) -> why it does not run here
SKIPPED = {
    "bash scripts/compare.sh": "the main job: minutes of training, data from the Hub",
    "SPANATTN_DATA=../shared/data bash scripts/compare.sh": "the main job: minutes of training",
    "bash scripts/test.sh": "the test suite, this test included",
    "torchrun --nproc_per_node 2": "two processes: the CPU command runs in the slow test below, the others need GPUs",
    "accelerate launch --multi_gpu": "needs GPUs",
}


@dataclass
class Block:
    line: int  # README line of the block's first line of code
    lang: str
    code: str


def readme_blocks(text: str) -> list[Block]:
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^```(\S*)\s*$", lines[i])
        if fence:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            blocks.append(Block(i + 2, fence[1], "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        i += 1
    return blocks


def shell_commands(block: Block) -> list[tuple[int, str]]:
    """(README line, command text) per command: lines joined over `\\` and open quotes."""
    commands, text, first = [], "", 0
    for n, line in enumerate(block.code.splitlines(), block.line):
        if not text:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            first = n
        text += line + "\n"
        if line.endswith("\\"):
            continue
        try:
            shlex.split(text, comments=True)
        except ValueError:  # a quote still open
            continue
        commands.append((first, text.replace("\\\n", " ")))
        text = ""
    assert not text, f"README.md:{first}: unfinished shell command {text!r}"
    return commands


def substitute(code: str, world: dict[str, str]) -> str:
    for hub, local in SUBSTITUTIONS.items():
        code = code.replace(hub, local.format(**world))
    return code


def check_installed(argv: list[str], line: int) -> None:
    """`pip install` of this checkout (with extras) or of named packages: already done here."""
    for spec in (a for a in argv[2:] if not a.startswith("-")):
        path, _, extras = re.match(r"^([^\[]*)(\[(.*)\])?$", spec).groups()
        if path.startswith("."):
            import hf_spanattn

            assert Path(hf_spanattn.__file__).resolve().is_relative_to(ROOT), \
                f"README.md:{line}: hf_spanattn is not installed from this checkout"
            for extra in filter(None, (extras or "").split(",")):
                requires = importlib.metadata.requires("hf_spanattn") or []
                names = [re.split(r"[<>=!~ ;\[]", r)[0] for r in requires if f'extra == "{extra}"' in r]
                assert names, f"README.md:{line}: hf_spanattn has no extra {extra!r}"
                for name in names:
                    importlib.metadata.version(name)
        else:
            importlib.metadata.version(spec)


class FakeHub:
    """What Transformers calls on the Hub API to push a model; keeps each model card it would upload."""

    def __init__(self):
        self.cards: list[str] = []

    def create_repo(self, repo_id, **kwargs):
        return types.SimpleNamespace(repo_id=repo_id)

    def create_commit(self, repo_id, operations, **kwargs):
        self.cards += [Path(op.path_or_fileobj).read_text() for op in operations if op.path_in_repo == "README.md"]


@pytest.fixture
def hub(monkeypatch) -> FakeHub:
    """Uploads go to a stand-in for the Hub API (nothing leaves the machine)."""
    import transformers.utils.hub
    from huggingface_hub.errors import EntryNotFoundError

    fake = FakeHub()
    route_hub(monkeypatch, fake, transformers.utils.hub)

    def no_card_yet(*args, **kwargs):
        raise EntryNotFoundError("no README.md in the repository yet")

    monkeypatch.setattr(transformers.utils.hub.ModelCard, "load", no_card_yet)
    return fake


@pytest.fixture
def world(tmp_path, monkeypatch):
    """A folder laid out as a clone next to `shared/`: recipes/ and ../shared/data reachable, tiny
    stand-ins for the Hub models, and local text for the Hub datasets."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / "recipes").symlink_to(ROOT / "recipes")
    (tmp_path / "shared").symlink_to(DATA.parent)
    local = tmp_path / "local"
    gpt2 = local / "gpt2"  # DistilGPT-2's 6 layers and tokenizer, one head 16 wide
    GPT2LMHeadModel(GPT2Config(n_embd=16, n_head=1, n_layer=6)).save_pretrained(gpt2)
    llama = local / "llama"  # grouped-query attention: 4 query heads on 2 key/value heads
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=50257, bos_token_id=50256, eos_token_id=50256)
    LlamaForCausalLM(config).save_pretrained(llama)
    for folder in (gpt2, llama):
        for file in (DATA / "gpt2-tokenizer").iterdir():
            shutil.copy(file, folder)
    lines = (DATA / "wikitext-2-raw-v1" / "train.PARTIAL-first-1MB.txt").read_text().splitlines()
    short = [line[:100].rstrip() for line in lines]  # about 25 tokens a line
    (local / "train.txt").write_text("".join(f"{line}\n" for line in short[:300]))
    (local / "validation.txt").write_text("".join(f"{line}\n" for line in short[300:360]))
    (local / "train.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in short[:300]))
    with open(local / "validation.csv", "w", newline="") as f:
        csv.writer(f).writerows([["text"]] + [[line] for line in short[300:360]])
    monkeypatch.chdir(clone)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    for offline in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(offline, "1")
    # one thread, here and in the commands: models this small gain nothing from more, and lose much
    # where the cores are shared
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield {"gpt2": str(gpt2), "llama": str(llama), "train": str(local / "train.txt"),
           "validation": str(local / "validation.txt"), "train_jsonl": str(local / "train.jsonl"),
           "validation_csv": str(local / "validation.csv")}
    torch.set_num_threads(threads)


def skipped(argv: list[str]) -> bool:
    return any(argv[:len(start)] == start for start in map(shlex.split, SKIPPED))


def run_command(line: int, argv: list[str], world: dict[str, str]) -> None:
    """One README command with its Hub names swapped (and a recipe run made tiny)."""
    argv = shlex.split(substitute(shlex.join(argv), world))
    if "recipes/run_clm.py" in argv:
        argv += TINY_RUN
    done = subprocess.run(["bash", "-c", shlex.join(argv)], capture_output=True, text=True, timeout=600)
    if done.returncode:
        pytest.fail(f"README.md:{line}: `{shlex.join(argv)}` exited with {done.returncode}:\n{done.stderr[-3000:]}")


def run_shell(block: Block, world: dict[str, str]) -> None:
    for line, text in shell_commands(block):
        argv = shlex.split(text, comments=True)
        if skipped(argv):
            continue
        if argv[:2] == ["pip", "install"]:
            check_installed(argv, line)
            continue
        run_command(line, argv, world)


def run_python(block: Block, namespace: dict, world: dict[str, str]) -> None:
    code = compile("\n" * (block.line - 1) + substitute(block.code, world), str(README), "exec")
    try:
        exec(code, namespace)
    except Exception as err:
        frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == str(README)]
        where = frames[-1].lineno if frames else block.line
        pytest.fail(f"README.md:{where}: the Python block at line {block.line} raised "
                    f"{type(err).__name__}: {err}\n{''.join(traceback.format_exception(err)[-12:])}")


def test_every_block_is_run_or_shown():
    langs = {block.lang for block in readme_blocks(README.read_text())}
    assert langs <= RUN | SHOWN, f"code blocks of unknown kind {langs - RUN - SHOWN}: name the language"


def test_every_substitution_and_skip_names_something_in_the_readme():
    text = README.read_text()
    commands = [shlex.split(c, comments=True) for b in readme_blocks(text) if b.lang == "bash"
                for _, c in shell_commands(b)]
    assert [hub for hub in SUBSTITUTIONS if hub not in text] == []
    assert [s for s in SKIPPED if not any(c[:len(shlex.split(s))] == shlex.split(s) for c in commands)] == []


def test_readme_snippets_run_as_written(world, hub):
    namespace: dict = {"__name__": "__readme__"}
    for block in readme_blocks(README.read_text()):
        if block.lang == "python":
            run_python(block, namespace, world)
        elif block.lang == "bash":
            run_shell(block, world)
    saved = json.loads((Path("my-model") / "config.json").read_text())
    assert saved["span_attention"]["method"] == "score"  # the snippets ran on the patched model
    assert hub.cards and all("hf_spanattn" in card for card in hub.cards)  # the pushed card names the method


@pytest.mark.slow
def test_readme_two_process_cpu_command_runs(world):
    """The README's command for two processes on a CPU machine (its other launcher commands need GPUs)."""
    commands = [(line, shlex.split(text, comments=True)) for block in readme_blocks(README.read_text())
                if block.lang == "bash" for line, text in shell_commands(block)]
    (cpu,) = [(line, argv) for line, argv in commands if argv[0] == "torchrun" and "--use_cpu" in argv]
    run_command(*cpu, world)


def test_every_relative_link_of_the_readme_and_docs_exists():
    broken = []
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path = target.split("#")[0]
            if path and "://" not in path and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def _documented_parameters(text: str) -> list[tuple[str, str | None]]:
    """`a, b=1, *, c="x", **kwargs` as [(name, default text or None)], `*` kept as a name."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, default = part.partition("=")
        out.append((name.strip(), default.strip() if eq else None))
    return out


def test_api_table_signatures_are_the_code():
    """Each call the README's API table shows names the function's parameters, in order, with its defaults."""
    import ast
    import importlib
    import inspect

    rows = re.findall(r"^\| `(hf_spanattn(?:\.\w+)+)\((.*?)\)` \|", README.read_text(), flags=re.M)
    assert len(rows) >= 7
    wrong = []
    for path, text in rows:
        module, _, name = path.rpartition(".")
        signature = inspect.signature(getattr(importlib.import_module(module), name))
        code = []
        for p in signature.parameters.values():
            if p.kind is p.KEYWORD_ONLY and "*" not in [n for n, _ in code]:
                code.append(("*", None))
            stars = "**" if p.kind is p.VAR_KEYWORD else "*" if p.kind is p.VAR_POSITIONAL else ""
            code.append((stars + p.name, p.default))
        documented = _documented_parameters(text)
        if [n for n, _ in documented] != [n for n, _ in code]:
            wrong.append(f"{path}: README names {[n for n, _ in documented]}, the code {[n for n, _ in code]}")
            continue
        for (n, shown), (_, default) in zip(documented, code):
            if shown is None:
                if default is not inspect.Parameter.empty and n != "*" and not n.startswith("*"):
                    wrong.append(f"{path}: {n} has a default ({default!r}) the README leaves out")
                continue
            try:
                same = ast.literal_eval(shown) == default
            except ValueError:
                same = shown == getattr(default, "__name__", None)
            if not same:
                wrong.append(f"{path}: {n}={shown} in the README, {default!r} in the code")
    assert wrong == []
