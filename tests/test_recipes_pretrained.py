"""recipes/run_clm.py from a pretrained start: a tiny GPT-2 and a tiny grouped-query Llama saved to a local
folder (built from configs, nothing downloaded), fine-tuned, saved and reloaded with their settings."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

import hf_spanattn
from hf_spanattn.integration.stored import config_of

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT / "recipes"))

import run_clm  # noqa: E402

pytestmark = pytest.mark.skipif(not (DATA / "gpt2-tokenizer").is_dir(), reason="needs ../shared/data")
TEXT = [f" The {w} of item {i} is {w * 2} ." for i, w in enumerate(["cat", "dog", "bird", "fish"] * 30)]
SMALL = {"block_size": 32, "num_train_epochs": 1, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
         "per_device_eval_batch_size": 8, "learning_rate": 1e-2, "disable_tqdm": True, "max_train_samples": 8,
         "max_eval_samples": 4, "save_strategy": "no", "load_best_model_at_end": False}


QUANTIZED = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
             "bnb_4bit_compute_dtype": "float32"}


def pretrained(folder: Path, family: str) -> Path:
    """A tiny model of `family` with the GPT-2 tokenizer, saved as a user's pretrained model would be."""
    tokenizer = AutoTokenizer.from_pretrained(DATA / "gpt2-tokenizer")
    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=len(tokenizer), n_positions=64))
    else:  # grouped-query attention: 4 query heads share 2 key/value heads
        model = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                             num_hidden_layers=2, intermediate_size=64, vocab_size=len(tokenizer),
                                             max_position_embeddings=64, bos_token_id=0, eos_token_id=0))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def data_files(folder: Path, kind: str) -> dict[str, str]:
    folder.mkdir()
    train, validation = folder / f"train.{kind}", folder / "validation.csv"
    if kind == "txt":
        train.write_text("\n".join(TEXT) + "\n")
    else:
        train.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(TEXT)))
    validation.write_text("text,source\n" + "".join(f'"{t}",x\n' for t in TEXT[:40]))
    return {"train_file": str(train), "validation_file": str(validation)}


@pytest.fixture(scope="module")
def gpt2_and_data(tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """(scratch folder, a tiny pretrained GPT-2, its data files), made once for the tests that only read them."""
    folder = tmp_path_factory.mktemp("shared")
    files = data_files(folder / "data", "txt")
    start = pretrained(folder / "start", "gpt2")
    (folder / "data" / "train.parquet").write_text("x")
    GPT2LMHeadModel(GPT2Config(n_embd=8, n_head=2, n_layer=1, n_positions=64, vocab_size=64)).save_pretrained(
        folder / "bare")  # a model saved without its tokenizer
    shutil.copytree(start, folder / "edited")
    config = json.loads((start / "config.json").read_text())
    (folder / "edited" / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 7}))
    (folder / "config_only").mkdir()
    shutil.copy(start / "tokenizer_config.json", folder / "config_only")
    T5ForConditionalGeneration(T5Config(d_model=8, d_ff=16, d_kv=4, num_heads=2, num_layers=1, vocab_size=64)
                               ).save_pretrained(folder / "t5")  # not a causal language model
    shutil.copytree(start, folder / "quantized")  # as Transformers saves a model it quantized (bitsandbytes 4-bit)
    (folder / "quantized" / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZED}))
    from peft import LoraConfig, get_peft_model

    get_peft_model(GPT2LMHeadModel.from_pretrained(start), LoraConfig(r=2, target_modules=["c_attn"])).save_pretrained(
        folder / "adapter")  # a LoRA adapter of the start, as a fine-tuning with PEFT leaves it
    shutil.copytree(start, folder / "cut")
    weights = (folder / "cut" / "model.safetensors").read_bytes()
    (folder / "cut" / "model.safetensors").write_bytes(weights[: len(weights) // 2])  # a copy stopped halfway
    return folder, start, files


def flags(args: dict) -> list[str]:
    """--key=value for each item, a bare --key for a value of None."""
    return [f"--{k}" if v is None else f"--{k}={v}" for k, v in args.items()]


@pytest.mark.parametrize("family,kind,span,layers", [("gpt2", "txt", "score:1000", None),
                                                     ("llama", "jsonl", "score:1100@per_block", "1")])
def test_fine_tunes_a_local_pretrained_model_and_saves_it_with_its_settings(family, kind, span, layers, tmp_path):
    start = pretrained(tmp_path / "start", family)
    out = tmp_path / "out"
    args = {**SMALL, **data_files(tmp_path / "data", kind), "model_name_or_path": start, "span": span,
            "output_dir": out, "logging_strategy": "steps", "logging_steps": 1}
    metrics = run_clm.main(flags({**args, **({"span_layers": layers} if layers else {})}))

    assert [h["step"] for h in metrics["train_history"]] == [1, 2]  # 8 blocks in batches of 4
    assert len(metrics["eval_history"]) == 1 and metrics["min_val_loss"] > 0
    saved = json.loads((out / "config.json").read_text())
    expected = hf_spanattn.SpanAttentionConfig.from_label(span, **({"layers": (1,)} if layers else {}))
    assert {k: v for k, v in saved["span_attention"].items() if k != "hf_spanattn_version"} == \
        {k: v for k, v in expected.to_dict().items() if k != "hf_spanattn_version"}
    assert saved["model_type"] == family and metrics["config"]["model"]["model_name_or_path"] == str(start)
    reloaded = hf_spanattn.load_pretrained(str(out))
    assert config_of(reloaded.config) == expected
    assert reloaded.config._attn_implementation == "span_attention"
    assert AutoTokenizer.from_pretrained(out).vocab_size == reloaded.config.vocab_size  # saved with its tokenizer
    before, after = load_file(start / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) >= len(before) - 1  # trained (a tied or unused tensor may stay)


def test_eval_only_reads_the_model_and_trains_nothing(tmp_path):
    start = pretrained(tmp_path / "start", "gpt2")
    out = tmp_path / "out"
    metrics = run_clm.main(flags({**SMALL, **data_files(tmp_path / "data", "txt"), "model_name_or_path": start,
                                  "output_dir": out, "do_train": False}))
    assert metrics["train_history"] == [] and metrics["final_train_loss"] is None
    assert metrics["min_val_loss"] > 0 and metrics["unigram_val_loss"] is None
    assert not (out / "model.safetensors").exists() and (out / "metrics.json").is_file()
    # the same model evaluated by hand gives the same loss
    model = hf_spanattn.load_pretrained(str(start), "standard:QKV111").eval()
    blocks = run_clm.build_datasets(run_clm.DataArguments(**{k: v for k, v in data_files(tmp_path / "d2", "txt")
                                                               .items()}, block_size=32, max_eval_samples=4),
                                    AutoTokenizer.from_pretrained(start),
                                    run_clm.TrainingArguments(str(tmp_path / "x"), do_eval=True))["validation"]
    with torch.no_grad():
        loss = model(input_ids=blocks[:]["input_ids"], labels=blocks[:]["labels"]).loss.item()
    assert metrics["min_val_loss"] == pytest.approx(loss, rel=1e-5)


def test_train_only_writes_no_evaluation(tmp_path):
    start = pretrained(tmp_path / "start", "gpt2")
    metrics = run_clm.main(flags({**SMALL, **data_files(tmp_path / "data", "txt"), "model_name_or_path": start,
                                  "output_dir": tmp_path / "out", "do_eval": False}))
    assert metrics["eval_history"] == [] and metrics["min_val_loss"] is None and metrics["final_train_loss"] > 0
    assert metrics["config"]["training"]["eval_strategy"] == "no"


def test_a_model_from_a_config_with_overrides_and_a_held_out_validation_split(tmp_path):
    start = pretrained(tmp_path / "start", "llama")
    files = data_files(tmp_path / "data", "txt")
    out = tmp_path / "out"
    overrides = "num_hidden_layers=1,attention_dropout=0.1"
    metrics = run_clm.main(flags({**SMALL, "train_file": files["train_file"], "config_name": start,
                                  "tokenizer_name": start, "config_overrides": overrides, "dtype": "float32",
                                  "output_dir": out, "validation_split_percentage": 20}))
    saved = json.loads((out / "config.json").read_text())
    assert saved["num_hidden_layers"] == 1 and saved["attention_dropout"] == 0.1
    assert saved["span_attention"]["method"] == "standard"
    assert metrics["config"]["model"]["config_overrides"] == overrides
    assert len(metrics["eval_history"]) == 1


def test_the_paper_gpt2_is_built_as_before_from_a_yaml_file(tmp_path):
    """One .yaml file gets the paper's defaults too; the from-scratch GPT-2 has the paper's shape."""
    config = tmp_path / "run.yaml"
    files = data_files(tmp_path / "data", "txt")
    config.write_text(f"train_file: {files['train_file']}\nvalidation_file: {files['validation_file']}\n"
                      f"tokenizer_name: {DATA / 'gpt2-tokenizer'}\noutput_dir: {tmp_path / 'out'}\n")
    model, data, span, training, *_ = run_clm.parse_args([str(config)])
    assert (model.n_embd, model.n_head, model.n_layer, model.dropout) == (256, 4, 6, 0.1)
    assert training.do_train and training.do_eval and training.gradient_accumulation_steps == 16
    assert data.files() == {"train": files["train_file"], "validation": files["validation_file"]}


@pytest.mark.parametrize("extra,message", [
    ({"n_head": 2}, "--n_head shapes the from-scratch GPT-2"),
    ({"dtype": "float16", "torch_dtype": "bfloat16"}, "--dtype float16 and --torch_dtype bfloat16"),
    ({"model_name_or_path": "./no-such-model"}, "--model_name_or_path ./no-such-model: no such folder"),
    ({"config_overrides": "n_layer"}, "--config_overrides 'n_layer': expected comma-separated key=value"),
    ({"config_overrides": "no_such_key=1"}, "--config_overrides: 'no_such_key' is not a setting of GPT2Config"),
    ({"config_overrides": "n_layer=two"}, "--config_overrides n_layer=two"),
    ({"block_size": 128}, "--block_size 128: the model reads at most 64 positions"),
    ({"span_layers": "5"}, "--span_layers: layers=[5]: GPT2LMHeadModel has layers 0..1"),
    ({"train_file": "{tmp}/missing.txt"}, "--train_file {tmp}/missing.txt: no such file"),
    ({"train_file": "{tmp}/data/train.parquet"}, "allowed file types are .txt, .text, .json, .jsonl, .csv"),
    ({"train_file": "{tmp}/data"}, "--train_file {tmp}/data: not a file"),
    ({"validation_split_percentage": 100}, "--validation_split_percentage 100: allowed values are 1 to 99"),
    ({"max_train_samples": 0}, "--max_train_samples 0: allowed values are >= 1"),
    ({"do_train": False, "do_eval": False}, "nothing to do"),
    ({"do_eval": False, "eval_strategy": "epoch"}, "--do_eval false and --eval_strategy epoch"),
    ({"output_dir": "{tmp}/data/train.parquet"}, "--output_dir {tmp}/data/train.parquet: exists and is not a folder"),
    ({"output_dir": "{tmp}/data/train.parquet/run"}, "{tmp}/data/train.parquet is a file"),
    ({"fsdp": "full_shard", "fsdp_config": '{"fsdp_version": 2}'}, "--fsdp: Accelerate shards only on GPUs"),
    ({"tokenizer_name": "./no-such-tokenizer"}, "--tokenizer_name ./no-such-tokenizer: no such folder"),
    ({"tokenizer_name": "{tmp}/start/tokenizer.json"},
     "--tokenizer_name {tmp}/start/tokenizer.json: a file, not a folder; give the folder that holds it ({tmp}/start)"),
    ({"model_name_or_path": "{tmp}/start/config.json"}, "--model_name_or_path {tmp}/start/config.json: a file, not"),
    ({"tokenizer_name": "{tmp}/data"}, "--tokenizer_name {tmp}/data: no tokenizer could be read from it"),
    ({"tokenizer_name": "{tmp}/config_only"}, "--tokenizer_name {tmp}/config_only: holds no tokenizer vocabulary"),
    ({"model_name_or_path": "{tmp}/bare"}, "--model_name_or_path {tmp}/bare: holds no tokenizer vocabulary"),
    ({"model_name_or_path": "{tmp}/t5", "tokenizer_name": "{tmp}/start"},
     "--model_name_or_path {tmp}/t5: a t5 model, which has no causal language model class"),
    ({"config_name": "{tmp}/t5"}, "--config_name {tmp}/t5: a t5 model"),
    ({"model_name_or_path": "{tmp}/cut"}, "--model_name_or_path {tmp}/cut: its weights could not be read"),
    ({"model_name_or_path": "{tmp}/edited"}, "--model_name_or_path {tmp}/edited: its weights do not fit the config of"),
    ({"model_name_or_path": "{tmp}/quantized"},
     "--model_name_or_path {tmp}/quantized: a quantized model (bitsandbytes, the quantization_config of its "
     "config.json); run_clm.py trains every"),
    ({"model_name_or_path": "{tmp}/quantized", "do_train": False}, "--model_name_or_path {tmp}/quantized: a quantized"),
    ({"model_name_or_path": "{tmp}/quantized", "config_name": "{tmp}/start"}, "--model_name_or_path {tmp}/quantized"),
    ({"model_name_or_path": "{tmp}/adapter"},
     "--model_name_or_path {tmp}/adapter: a PEFT adapter (adapter_config.json, on the base model {tmp}/start), not a "
     "model (no config.json)"),
    ({"config_name": "{tmp}/adapter"}, "--config_name {tmp}/adapter: a PEFT adapter"),
])
def test_bad_arguments_fail_before_any_data_is_read(extra, message, gpt2_and_data, tmp_path, monkeypatch):
    monkeypatch.setattr(run_clm, "load_texts", lambda *a: pytest.fail("data was read"))
    folder, start, files = gpt2_and_data
    args = {**SMALL, **files, "model_name_or_path": start, "output_dir": tmp_path / "out", **extra}
    args = {k: v if v is None else str(v).replace("{tmp}", str(folder)) for k, v in args.items()}
    with pytest.raises(ValueError) as err:
        run_clm.main(flags(args))
    assert message.replace("{tmp}", str(folder)) in str(err.value)


def test_config_overrides_that_reshape_a_pretrained_model_name_the_flag(gpt2_and_data):
    """`--config_overrides n_embd=64` on a pretrained model failed inside Transformers' loading, naming the weights
    but not the flag; a setting that does not shape the model (resid_pdrop) still loads the weights."""
    _, start, _ = gpt2_and_data
    tokenizer = AutoTokenizer.from_pretrained(start)
    data = run_clm.DataArguments(block_size=32)
    args = {"model_name_or_path": str(start)}
    with pytest.raises(ValueError, match=r"--config_overrides n_embd=64: the weights of .* do not fit .*--config_name"):
        run_clm.build_model(run_clm.ModelArguments(**args, config_overrides="n_embd=64"), data, tokenizer)
    model = run_clm.build_model(run_clm.ModelArguments(**args, config_overrides="resid_pdrop=0.3"), data, tokenizer)
    assert model.config.resid_pdrop == 0.3


def test_the_config_of_a_quantized_model_gives_the_architecture_only(gpt2_and_data, caplog):
    """--config_name of a quantized model kept its quantization_config on the model built from it: saved with it, the
    trained weights were quantized at every reload (a pretrained start's, on loading, and the Trainer refused it).
    Now the field goes, with a warning, and the model is the one the config shapes, unquantized."""
    folder, start, _ = gpt2_and_data
    tokenizer, data = AutoTokenizer.from_pretrained(start), run_clm.DataArguments(block_size=32)
    quantized = str(folder / "quantized")
    for args in ({"config_name": quantized}, {"config_name": quantized, "model_name_or_path": str(start)}):
        with caplog.at_level("WARNING", logger=run_clm.logger.name):
            model = run_clm.build_model(run_clm.ModelArguments(**args), data, tokenizer)
        assert f"--config_name {quantized}: the config of a quantized model (bitsandbytes)" in caplog.text
        assert not hasattr(model.config, "quantization_config") and not getattr(model, "is_quantized", False)
        assert "quantization_config" not in model.config.to_dict()
    stock = GPT2LMHeadModel.from_pretrained(start)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), stock.state_dict().values()))
    # a quantization that Transformers trains whole (BitNet's online quantization-aware training) is the Trainer's
    qat = {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "online"}
    for args in ({"model_name_or_path": str(start)}, {"config_name": str(start)}):
        config = run_clm.AutoConfig.from_pretrained(start)
        config.quantization_config = qat
        run_clm.refuse_quantized(run_clm.ModelArguments(**args), config)
        assert config.quantization_config == qat


def test_a_start_saved_with_an_attention_not_installed_here_loads_as_sdpa(gpt2_and_data, tmp_path):
    """A config.json naming flash_attention_2 (saved so by another machine, or by hand) stopped the run with
    Transformers' ImportError, though the patch replaces that attention."""
    _, start, _ = gpt2_and_data
    shutil.copytree(start, tmp_path / "start")
    config = json.loads((start / "config.json").read_text())
    (tmp_path / "start" / "config.json").write_text(json.dumps({**config, "_attn_implementation": "flash_attention_2"}))
    tokenizer, data = AutoTokenizer.from_pretrained(start), run_clm.DataArguments(block_size=32)
    model, stock = (run_clm.build_model(run_clm.ModelArguments(model_name_or_path=str(s)), data, tokenizer).eval()
                    for s in (tmp_path / "start", start))
    ids = torch.randint(len(tokenizer), (2, 16))
    assert torch.equal(model(ids).logits, stock(ids).logits)


def test_a_tokenizer_whose_ids_leave_gaps_gets_rows_for_its_highest_id(gpt2_and_data):
    """A vocabulary trimmed by hand (ids 0, 1 and 60000) has 3 tokens but needs 60001 rows: the model was resized to
    len(tokenizer) only, and the first batch holding the highest id stopped with "IndexError: index out of range"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    _, start, _ = gpt2_and_data
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 60000}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    for args in ({"model_name_or_path": str(start)}, {}):  # pretrained (50257 rows), and from scratch
        shape = run_clm.ModelArguments(**args, n_layer=None if args else 1)
        model = run_clm.build_model(shape, run_clm.DataArguments(block_size=32), tokenizer)
        ids = torch.tensor([tokenizer("a b a b").input_ids])
        assert model.get_input_embeddings().weight.shape[0] == 60001 and model(ids).logits.shape == (1, 4, 60001)


def test_a_tokenizer_of_a_short_model_max_length_reads_long_texts_without_a_false_warning(tmp_path, caplog,
                                                                                          monkeypatch):
    """Transformers warned that texts longer than the tokenizer's model_max_length "will result in indexing errors",
    which the blocks of --block_size never give."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    tokenizer = AutoTokenizer.from_pretrained(DATA / "gpt2-tokenizer", model_max_length=8)
    (tmp_path / "train.txt").write_text(" ".join(TEXT) + "\n")
    data = run_clm.DataArguments(train_file=str(tmp_path / "train.txt"), block_size=32, overlap=0)
    blocks = run_clm.build_datasets(data, tokenizer, run_clm.TrainingArguments(str(tmp_path), do_train=True))["train"]
    ids = tokenizer(" ".join(TEXT) + "\n", verbose=False)["input_ids"]
    assert blocks[0]["input_ids"].tolist() == ids[:32] and len(blocks) == len(ids) // 32
    assert "indexing errors" not in caplog.text
