"""benchmarks/published_runs.py: every row is cited, measured and self-consistent."""

import dataclasses
import math
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))

import published_runs  # noqa: E402
from published_runs import RUNS, PublishedRun  # noqa: E402

MEASURED = ("mfu", "tokens_per_second_per_chip", "step_seconds", "tflops_per_chip")
MODEL_KEYS = {"layers", "width", "hidden", "heads", "kv_heads", "head_dim", "vocab", "activation"}
IDS = [run.name for run in RUNS]


def maxtext_keys(config):
    pairs = [item.split("=", 1) for item in config.split()]
    assert all(len(pair) == 2 and pair[0] and pair[1] for pair in pairs), config
    keys = dict(pairs)
    assert len(keys) == len(pairs), f"a key is given twice: {config}"
    return keys


def test_rows_cover_what_the_predictor_is_calibrated_on():
    assert len(RUNS) >= 6
    assert len(set(IDS)) == len(IDS)
    assert sum(run.framework == "maxtext" for run in RUNS) >= 3
    assert any(run.chip == "h100" and run.mesh["pipe"] > 1 for run in RUNS)
    assert published_runs.by_name(IDS[0]) is RUNS[0]
    with pytest.raises(KeyError, match=IDS[0]):
        published_runs.by_name("no-such-run")


@pytest.mark.parametrize("run", RUNS, ids=IDS)
def test_row_is_cited_and_measured(run):
    assert run.framework in published_runs.FRAMEWORKS and run.chip in published_runs.CHIPS
    assert len(run.source) > 40 and ("github.com/" in run.source)
    assert any(getattr(run, field) is not None for field in MEASURED)
    for field in MEASURED:
        value = getattr(run, field)
        assert value is None or value > 0
    assert run.mfu is None or 0 < run.mfu < 1
    if None not in (run.mfu, run.tflops_per_chip, run.peak_tflops):
        assert run.tflops_per_chip / run.peak_tflops == pytest.approx(run.mfu, abs=0.005)
    assert run.flops_convention


@pytest.mark.parametrize("run", RUNS, ids=IDS)
def test_mesh_batch_and_topology_agree_with_chips(run):
    assert tuple(run.mesh) == published_runs.MESH_AXES
    assert all(isinstance(n, int) and n >= 1 for n in run.mesh.values())
    assert math.prod(run.mesh.values()) == run.chips
    if run.per_device_batch is not None and run.global_batch is not None:
        assert run.per_device_batch * run.chips == run.global_batch
    if run.chip == "h100":
        assert run.topology is None
    else:
        kind, dims = run.topology.split(":")
        assert kind == run.chip
        assert math.prod(int(d) for d in dims.split("x")) == run.chips
        assert published_runs.AOT_TOPOLOGIES[run.topology] == run.chips
    if run.mesh["pipe"] > 1:
        assert run.pipeline_schedule is not None or "pipeline_schedule" in run.unstated
    else:
        assert run.pipeline_schedule is None and run.microbatches is None


@pytest.mark.parametrize("run", RUNS, ids=IDS)
def test_model_and_unstated_fields_are_named(run):
    assert set(run.model) >= MODEL_KEYS
    assert run.seq > 0 and run.model["layers"] > 0
    fields = {f.name for f in dataclasses.fields(PublishedRun)}
    for name in run.unstated:
        assert name in fields or (name.startswith("model.") and name[6:] in run.model), name
    # a configuration field left empty says so
    for name in ("slices", "remat", "attention", "precision", "optimizer"):
        assert getattr(run, name) is not None or name in run.unstated, name
    if run.mfu is not None:
        assert run.peak_tflops is not None or "peak_tflops" in run.unstated
    if run.mesh["pipe"] > 1:
        assert run.microbatches is not None or "microbatches" in run.unstated
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.chips = 1
    with pytest.raises(TypeError):
        run.mesh["data"] = 2


MAXTEXT_RUNS = [run for run in RUNS if run.framework == "maxtext"]


@pytest.mark.parametrize("run", MAXTEXT_RUNS, ids=[run.name for run in MAXTEXT_RUNS])
def test_maxtext_config_builds_the_row(run):
    keys = maxtext_keys(run.maxtext_config)
    maxtext_keys(run.source_config)
    assert float(keys["per_device_batch_size"]) == run.per_device_batch
    assert int(keys["max_target_length"]) == run.seq
    assert keys["remat_policy"] == run.remat
    assert keys.get("attention", "flash") == run.attention
    assert keys["ici_fsdp_parallelism"] == "-1"
    assert int(keys.get("ici_tensor_parallelism", 1)) == run.mesh["tensor"]
    assert run.mesh["fsdp"] == run.chips // run.mesh["tensor"]
    if "model_name" not in keys:
        shapes = {
            "base_emb_dim": "width",
            "base_num_query_heads": "heads",
            "base_num_kv_heads": "kv_heads",
            "base_mlp_dim": "hidden",
            "base_num_decoder_layers": "layers",
            "head_dim": "head_dim",
            "vocab_size": "vocab",
        }
        for key, field in shapes.items():
            assert int(keys[key]) == run.model[field], key
        assert keys["mlp_activations"] == f"[{run.model['activation']}]"
    assert run.xla_flags
    for group, flags in run.xla_flags.items():
        assert group.isupper() and flags.split()
        assert all(flag.startswith("--xla_") and "=" in flag for flag in flags.split())
    assert run.libtpu_init_args().split() == " ".join(run.xla_flags.values()).split()


def test_only_maxtext_rows_carry_maxtext_configs():
    for run in RUNS:
        if run.framework != "maxtext":
            assert run.maxtext_config is None and run.source_config is None
            assert not run.xla_flags


@pytest.mark.parametrize("name,run_name", [
    ("llama2-70b", "maxtext-llama2-70b-v5p-512"), ("maxtext-32b", "maxtext-32b-v5p-64"),
    ("maxtext-64b", "maxtext-64b-v5p-64"),
])  # fmt: skip
def test_the_planners_benchmark_models_have_the_runs_shapes_and_work_a_chip(name, run_name):
    """benchmarks/plan.py plans these models on 64 v5p chips (v5p:4x4x4) at the published
    run's shapes and work a chip: rows of its sequence length, its rows a chip."""
    import plan

    run = published_runs.by_name(run_name)
    layers, params, _, head, _, inputs, targets = plan.model(name)
    m = run.model
    rows, tokens, width = inputs.shape
    assert (layers, width, tokens, rows) == (m["layers"], m["width"], run.seq,
                                            run.per_device_batch * 64)  # fmt: skip
    head_dim = plan.HEAD_DIM.get(name, 128)
    assert head_dim == m["head_dim"]
    assert params["wq"].shape == (width, m["heads"] * head_dim)
    assert params["wk"].shape == (width, m["kv_heads"] * head_dim)
    assert params["w_up"].shape == (width, m["hidden"]) and head["out"].shape[1] == m["vocab"]
    assert ("w_gate" in params) == (m["activation"] == "swiglu")
    assert targets.shape == (rows, tokens)
