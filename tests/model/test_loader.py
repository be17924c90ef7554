"""Checkpoint loading: sharded files, and clear errors naming the file and field."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import greedy, make_engine, random_prompts, run_to_end
from safetensors.torch import load_file, save_file

from kvserve.model.loader import WeightLoadError
from kvserve.model.spec import ModelConfigError, load_model_spec


def _edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


def test_sharded_checkpoint_loads_identically(llama_dir, copy_model):
    d = copy_model(llama_dir)
    tensors = load_file(d / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for fname, part in shards.items():
        save_file({n: tensors[n] for n in part}, d / fname)
    (d / "model.safetensors").unlink()
    index = {"weight_map": {n: f for f, part in shards.items() for n in part}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    prompt = random_prompts([20])[0]
    outs = []
    for model in (llama_dir, d):
        e = make_engine(model)
        e.add_request("a", prompt, greedy(8))
        outs.append(run_to_end(e)["a"])
    assert outs[0] == outs[1]


def test_unsupported_architecture_names_file_and_field(llama_dir, copy_model):
    d = copy_model(llama_dir)
    _edit_config(d, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelConfigError, match=r"config\.json.*'architectures'.*GPT2LMHeadModel"):
        load_model_spec(d)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"hidden_size": None}, "hidden_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}, "rope_type"),
        ({"vocab_size": "many"}, "vocab_size"),
    ],
)
def test_config_we_cannot_honour_is_a_clear_error(llama_dir, copy_model, change, field):
    d = copy_model(llama_dir)
    _edit_config(d, **change)
    with pytest.raises(ModelConfigError, match=rf"config\.json.*{field}"):
        load_model_spec(d)


def test_missing_tensor_is_named(llama_dir, copy_model):
    d = copy_model(llama_dir)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        make_engine(d)


def test_mismatched_tensor_shape_is_named(llama_dir, copy_model):
    d = copy_model(llama_dir)
    tensors = load_file(d / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(WeightLoadError, match=r"model\.safetensors.*model\.norm\.weight.*\[7\]"):
        make_engine(d)


def test_unknown_tensor_is_an_error(llama_dir, copy_model):
    d = copy_model(llama_dir)
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.mystery.weight"] = torch.ones(3)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(WeightLoadError, match="mystery"):
        make_engine(d)


def test_no_weights_at_all(llama_dir, copy_model):
    d = copy_model(llama_dir)
    (d / "model.safetensors").unlink()
    with pytest.raises(WeightLoadError, match=r"no \*\.safetensors"):
        make_engine(d)
