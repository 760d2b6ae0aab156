"""SpanAttentionConfig: validation, the paper's labels, dict round trips."""

import pytest

from hf_spanattn import SpanAttentionConfig

LABELS = ["score:1000", "score:1000@per_block", "reductionistic:1100", "simple:10", "standard:QKV101",
          "standard:QKV111", "score:1000+QKV110", "score:1,0.5,0,0", "simple:0.3,1.7"]


@pytest.mark.parametrize("label", LABELS)
def test_label_round_trip(label):
    config = SpanAttentionConfig.from_label(label)
    assert config.label == label
    assert SpanAttentionConfig.from_label(config.label) == config
    assert SpanAttentionConfig.from_dict(config.to_dict()) == config


def test_label_fields():
    c = SpanAttentionConfig.from_label("score:1100@per_block")
    assert (c.method, c.alphas, c.score_grad, c.qkv_alphas) == ("score", (1, 1, 0, 0), "per_block", (1, 1, 1))
    c = SpanAttentionConfig.from_label("standard:QKV101")
    assert (c.method, c.alphas, c.qkv_alphas) == ("standard", (), (1, 0, 1))
    assert SpanAttentionConfig.from_label("score:1000", layers=[3, 1]).layers == (1, 3)


def test_defaults_are_the_papers_best():
    assert SpanAttentionConfig().label == "score:1000"
    assert SpanAttentionConfig(method="simple").alphas == (1.0, 0.0)
    assert SpanAttentionConfig().replace(method="reductionistic").label == "reductionistic:1000"


@pytest.mark.parametrize("kwargs,field,allowed", [
    (dict(method="fancy"), "method='fancy'", "standard, simple, reductionistic, score"),
    (dict(method="score", alphas=(1, 0)), "alphas=(1, 0)", "4 values"),
    (dict(method="simple", alphas=(1, 0, 0, 0)), "alphas=(1, 0, 0, 0)", "2 values"),
    (dict(method="standard", alphas=(1,)), "alphas=(1,)", "standard takes no alphas"),
    (dict(alphas=(1, -1, 0, 0)), "alphas=(1, -1, 0, 0)", ">= 0"),
    (dict(alphas=(1, float("nan"), 0, 0)), "alphas=", "finite"),
    (dict(alphas="1000"), "alphas='1000'", "sequence of 4 numbers"),
    (dict(score_grad="hooks"), "score_grad='hooks'", "exact, per_block"),
    (dict(method="reductionistic", score_grad="per_block"), "score_grad='per_block'", "only method='score'"),
    (dict(qkv_alphas=(1, 1)), "qkv_alphas=(1, 1)", "3 values"),
    (dict(layers=[0, -1]), "layers=[0, -1]", "non-negative"),
])
def test_invalid_values_name_the_field(kwargs, field, allowed):
    with pytest.raises(ValueError) as err:
        SpanAttentionConfig(**kwargs)
    assert field in str(err.value) and allowed in str(err.value)


@pytest.mark.parametrize("label", ["score:10", "bogus:1", "score:", "score:1000@x", "simple:10@per_block", "1000"])
def test_bad_labels(label):
    with pytest.raises(ValueError):
        SpanAttentionConfig.from_label(label)


def test_unknown_fields_from_a_newer_version_warn():
    data = {**SpanAttentionConfig.from_label("score:1100").to_dict(), "shiny": 1, "hf_spanattn_version": "9.0"}
    with pytest.warns(UserWarning, match="written by hf_spanattn 9.0, newer than the installed"), \
            pytest.warns(UserWarning, match=r"ignoring unknown fields \['shiny'\].*9.0"):
        config = SpanAttentionConfig.from_dict(data)
    assert config.label == "score:1100"


def test_save_and_load_records_the_version(tmp_path):
    import json

    import hf_spanattn

    config = SpanAttentionConfig.from_label("score:1100@per_block", layers=[2, 3])
    path = config.save_pretrained(tmp_path)
    saved = json.loads(open(path).read())
    assert saved["hf_spanattn_version"] == hf_spanattn.__version__
    assert SpanAttentionConfig.from_pretrained(tmp_path) == config
    assert SpanAttentionConfig.from_pretrained(path) == config


def test_hub_round_trip_with_only_the_network_stubbed(tmp_path, monkeypatch):
    """push_to_hub and from_pretrained(repo_id) run for real down to huggingface_hub's HTTP layer."""
    import huggingface_hub

    store: dict[str, bytes] = {}
    calls = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id, kwargs.get("private")))

    def upload_file(self, *, path_or_fileobj, path_in_repo, repo_id, **kwargs):
        store[f"{repo_id}/{path_in_repo}"] = path_or_fileobj
        return f"https://huggingface.co/{repo_id}/commit/0"

    def hf_hub_download(repo_id, filename, **kwargs):
        out = tmp_path / "cache" / filename
        out.parent.mkdir(exist_ok=True)
        out.write_bytes(store[f"{repo_id}/{filename}"])
        return str(out)

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_file", upload_file)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    config = SpanAttentionConfig.from_label("reductionistic:1100+QKV101")
    url = config.push_to_hub("me/recipe", private=True)
    assert url.endswith("/commit/0") and calls == [("create_repo", "me/recipe", True)]
    assert SpanAttentionConfig.from_pretrained("me/recipe") == config


@pytest.mark.parametrize("kwargs", [
    dict(alphas=(1e-5, 0, 0, 0)),
    dict(alphas=(0.1 + 0.2, 1 / 3, 5e-324, 1.7976931348623157e308)),
    dict(alphas=(1e20, 12, 0, 0.5), qkv_alphas=(1e-7, 1, 2.5)),
    dict(method="simple", alphas=(0.123456789, 10)),
    dict(method="reductionistic", alphas=(1, 1e-300, 0, 0), score_grad="exact", qkv_alphas=(1, 0, 1e16)),
    dict(method="standard", qkv_alphas=(1e-5, 1, 0)),
    dict(alphas=(3e-8, 1, 1, 1), score_grad="per_block"),
])
def test_every_valid_config_label_reads_back_as_the_same_config(kwargs):
    config = SpanAttentionConfig(**kwargs)
    assert SpanAttentionConfig.from_label(config.label) == config, config.label
    assert SpanAttentionConfig.from_label(config.label).label == config.label


@pytest.mark.parametrize("label,canonical", [
    ("score:1,0,0,0", "score:1000"), ("score:1.0,0,0,0.0", "score:1000"), ("score:1000+QKV111", "score:1000"),
    ("score:1000+QKV1,1,1", "score:1000"), ("simple:1e0,0", "simple:10"), ("score:0.5,5e-1,0,0", "score:0.5,0.5,0,0"),
    ("standard:QKV1.0,0,1", "standard:QKV101"), ("score:1000@exact", "score:1000"),
])
def test_one_setting_has_one_label(label, canonical):
    assert SpanAttentionConfig.from_label(label) == SpanAttentionConfig.from_label(canonical)
    assert SpanAttentionConfig.from_label(label).label == canonical


def test_a_newer_version_warns_naming_both_versions_and_the_file(tmp_path):
    import json

    import hf_spanattn

    path = tmp_path / "span_attention_config.json"
    path.write_text(json.dumps({**SpanAttentionConfig().to_dict(), "hf_spanattn_version": "99.1"}))
    with pytest.warns(UserWarning, match=rf"{path}: hf_spanattn_version='99.1': the settings were written by "
                                         rf"hf_spanattn 99.1, newer than the installed {hf_spanattn.__version__}"):
        assert SpanAttentionConfig.from_pretrained(tmp_path) == SpanAttentionConfig()


def test_a_newer_version_on_a_saved_model_warns_once_naming_its_config_json(tmp_path):
    import json
    import warnings

    import torch
    from models import VOCAB, tiny

    from hf_spanattn import load_pretrained, patch_model

    patch_model(tiny("gpt2"), "score:1100").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["span_attention"]["hf_spanattn_version"] = "98.0"
    (tmp_path / "config.json").write_text(json.dumps(config))
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_pretrained(str(tmp_path))
        for _ in range(2):
            model(ids, labels=ids).loss.backward()
    newer = [str(w.message) for w in caught if "newer than the installed" in str(w.message)]
    assert len(newer) == 1 and f"{tmp_path}/config.json, field 'span_attention': hf_spanattn_version='98.0'" \
        in newer[0], newer


def test_an_unknown_field_warns_with_the_known_one_it_is_near():
    with pytest.warns(UserWarning, match=r"ignoring unknown fields \['alpha'\].*did you mean 'alphas' for 'alpha'"):
        SpanAttentionConfig.from_dict({"method": "score", "alpha": [1, 1, 0, 0]})


def test_numpy_and_tensor_numbers_are_taken_as_plain_numbers():
    """Layers as NumPy integers (an arange), alphas as NumPy floats or 0-d tensors: the same config as
    with Python numbers, and it still saves as JSON."""
    import json

    import numpy as np
    import torch

    config = SpanAttentionConfig(alphas=np.array([1, 0.5, 0, 0], dtype=np.float32), layers=np.arange(2, 4),
                                 qkv_alphas=(torch.tensor(1.0), np.float64(0.5), 1))
    assert config == SpanAttentionConfig(alphas=(1, 0.5, 0, 0), layers=[3, 2], qkv_alphas=[1, 0.5, 1])
    assert type(config.layers[0]) is int and type(config.alphas[1]) is float
    assert SpanAttentionConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
