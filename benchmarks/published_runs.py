"""Published, measured training runs with their configuration: calibration data for a
step-time predictor. Plain Python, no JAX.

Every figure comes from the source named in the row's ``source`` (repository, commit, path
and line, or document and table). Where that source does not state a field, the row fills it
from the framework's own code or config at the same commit, or leaves it ``None`` where
nothing says, and names it in ``unstated``; ``notes`` says from where. Nothing here is
estimated.

Conventions:
- ``chips``: accelerator chips (a v5p chip is two TensorCores: Google's ``v5p-128`` is 64
  chips; ``v5e-256`` and ``v6e-256`` are 256 chips).
- ``topology``: the name ``jax.experimental.topologies.get_topology_desc(platform="tpu",
  topology_name=...)`` takes (``None`` for GPUs). See ``AOT_TOPOLOGIES``.
- ``mesh``: the framework's parallel degrees, keys ``data fsdp tensor pipe expert context``;
  MaxText's ``-1`` is resolved to the chips left. Their product is ``chips``.
- ``per_device_batch``: rows per chip (``global_batch / chips``); for MaxText this is its
  ``per_device_batch_size``.
- ``mfu``: a fraction; ``peak_tflops``: the per-chip peak the source divides by (``None``
  where the source does not state it); ``flops_convention``: how the source counts model
  FLOPs.
- ``source_config``: the source's own overrides, verbatim less data, profiler, logging and
  checkpoint keys. ``maxtext_config``: the overrides that build the same model and mesh with
  today's MaxText (``train_compile``); for the 2023 rows the base.yml defaults of the time
  are spelled out, since today's differ.
- ``xla_flags``: flag group name (MaxText's ``benchmarks/xla_flags_library.py`` at the row's
  commit, or ``LIBTPU_INIT_ARGS`` for a script's literal string) -> the flags.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping

MESH_AXES = ("data", "fsdp", "tensor", "pipe", "expert", "context")
FRAMEWORKS = ("maxtext", "megatron-lm", "torchtitan")
CHIPS = ("v5p", "v5e", "v6e", "h100")

# jax 0.10.2 with the installed libtpu, on this CPU machine (ALLOW_MULTIPLE_LIBTPU_LOAD=1):
#   topologies.get_topology_desc(platform="tpu", topology_name=name).devices
# gave these device counts; every name tried was accepted.
AOT_TOPOLOGIES = types.MappingProxyType(
    {
        "v5p:4x4x4": 64,
        "v5p:4x4x8": 128,
        "v5p:8x8x8": 512,
        "v5e:8x8": 64,
        "v5e:8x16": 128,
        "v5e:16x16": 256,
        "v6e:8x8": 64,
        "v6e:8x16": 128,
        "v6e:16x16": 256,
    }
)

MAXTEXT = "github.com/AI-Hypercomputer/maxtext"
MEGATRON = "github.com/NVIDIA/Megatron-LM"
TORCHTITAN = "github.com/pytorch/torchtitan"

# ------------------------------------------------------------------ XLA flag groups
# benchmarks/xla_flags_library.py at 92e59fdf547421f647590087f50fea5729da42d8 (lines 33,
# 39-45, 121-125, 138-141, 152-164).
DENSE_VMEM_LIMIT_FLAG = "--xla_tpu_scoped_vmem_limit_kib=98304"
CF_FOR_ALL_GATHER = (
    "--xla_tpu_enable_async_collective_fusion=true"
    " --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true"
    " --xla_tpu_enable_async_collective_fusion_multiple_steps=true"
    " --xla_tpu_overlap_compute_collective_tc=true"
    " --xla_enable_async_all_gather=true"
)
LAYOUT_FOR_ALL_REDUCE_SCATTER = (
    "--xla_tpu_use_minor_sharding_for_major_trivial_input=true"
    " --xla_tpu_relayout_group_size_threshold_for_reduce_scatter=1"
    " --xla_tpu_assign_all_reduce_scatter_layout=true"
)
DATA_PARALLEL_OVERLAP = (
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true"
    " --xla_tpu_data_parallel_opt_different_sized_ops=true"
)
HOST_OFFLOAD_FLAGS = (
    "--xla_tpu_enable_all_experimental_scheduler_features=true"
    " --xla_tpu_enable_scheduler_memory_pressure_tracking=true"
    " --xla_tpu_host_transfer_overlap_limit=24"
    " --xla_tpu_aggressive_opt_barrier_removal=ENABLED"
    " --xla_lhs_prioritize_async_depth_over_stall=ENABLED"
    " --xla_tpu_enable_ag_backward_pipelining=true"
    " --xla_should_allow_loop_variant_parameter_in_chain=ENABLED"
    " --xla_should_add_loop_invariant_op_in_chain=ENABLED"
    " --xla_max_concurrent_host_send_recv=100"
    " --xla_tpu_scheduler_percent_shared_memory_limit=100"
    " --xla_latency_hiding_scheduler_rerun=2"
)
# MaxText/configs/v5p/{32b,64b}.sh:30 at 76bd53b0f44caf989c88189afadeb1062f9254f0 (no
# fuse_all_gather: it came back in 64c851db4, 2024-01-23).
V5P_2023_LIBTPU_INIT_ARGS = (
    "--xla_tpu_megacore_fusion_allow_ags=false"
    " --xla_enable_async_collective_permute=true"
    " --xla_tpu_enable_ag_backward_pipelining=true"
    " --xla_tpu_enable_data_parallel_all_reduce_opt=true"
    " --xla_tpu_data_parallel_opt_different_sized_ops=true"
    " --xla_tpu_enable_async_collective_fusion=true"
    " --xla_tpu_enable_async_collective_fusion_multiple_steps=true"
    " --xla_tpu_overlap_compute_collective_tc=true"
    " --xla_enable_async_all_gather=true"
)
# end_to_end/test_tflops_32b_params.sh:18 at ebb226da831210cf6d6ff774aef937689bb1d612: the
# same seven flags as DATA_PARALLEL_OVERLAP + CF_FOR_ALL_GATHER, in another order.
V5E_2023_LIBTPU_INIT_ARGS = (
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true"
    " --xla_tpu_data_parallel_opt_different_sized_ops=true"
    " --xla_tpu_enable_async_collective_fusion=true"
    " --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true"
    " --xla_tpu_enable_async_collective_fusion_multiple_steps=true"
    " --xla_tpu_overlap_compute_collective_tc=true"
    " --xla_enable_async_all_gather=true"
)

# ------------------------------------------------------------------ FLOP conventions
MAXTEXT_2025 = (
    "MaxText calculate_tflops_training_per_device (src/MaxText/maxtext_utils.py:454 at "
    "92e59fdf): per device and step, 3*[L*(ffn + qkv + proj) + logits] + 3*L*attn with "
    "ffn = 2*B*S*emb*mlp*(len(mlp_activations) + 1), qkv = 2*B*S*emb*(H + 2*K)*hd, "
    "proj = 2*B*S*emb*H*hd, logits = 2*B*S*emb*V, attn = 4*B*S^2*H*hd / 2 (causal half, "
    "PR #1988, merged 2adc3bab1 2025-07-22); remat recompute not counted. MFU = that / step "
    "time / peak (MaxText's peaks, benchmarks/upload_metrics_to_bq.py:34-40 at 92e59fdf: "
    "v5e 197, v5p 459, v6e 918, a3mega (H100) 989 TFLOP/s)."
)
MAXTEXT_2023_DEC = (
    "MaxText calculate_training_tflops (MaxText/train.py:77 at 76bd53b0f): per device and "
    "step, 6*N*S*B + 12*H*L*hd*S^2*B / 2 (causal half), N = all parameters (embedding "
    "shared with the logits: logits_via_embedding=True)."
)
MAXTEXT_2023_OCT = (
    "MaxText calculate_training_tflops (MaxText/train.py:75 at ebb226da8): per device and "
    "step, 6*N*S*B + 12*H*L*hd*S^2*B, attention counted in full (no causal half), "
    "N = all parameters (embedding shared with the logits)."
)
MEGATRON_2024 = (
    "Megatron num_floating_point_operations (megatron/training/training.py:73-108 at "
    "f2e5db402c): per step 12*B*s*L*h^2*[(1 + g/a + s/h)*(q/h) + (f/h)*k*(3/2 if swiglu) + "
    "V/(2*L*h)]; for these GPT rows (g = a, q = h, f = 4h, k = 1) 72*B*s*L*h^2*(1 + s/(6h) + "
    "V/(12*L*h)), the Megatron paper's formula without recompute; attention counted in "
    "full (no causal half); recompute not counted."
)
TORCHTITAN_2024 = (
    "No FLOPs figure is published for these rows (the page reports no MFU when Float8 is "
    "on). torchtitan's own logged MFU uses 6*N + 12*l*h*q*t FLOPs per token, attention in "
    "full (torchtitan/utils.py:268-283 at 9dec370)."
)


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    """One measured run. See the module docstring for the conventions."""

    name: str
    framework: str
    model: Mapping[str, object]
    seq: int
    chip: str
    chips: int
    topology: str | None
    mesh: Mapping[str, int]
    slices: int | None
    per_device_batch: float | None
    global_batch: int | None
    remat: str | None
    attention: str | None
    precision: str | None
    optimizer: str | None
    flops_convention: str
    source: str
    mfu: float | None = None
    tokens_per_second_per_chip: float | None = None
    step_seconds: float | None = None
    tflops_per_chip: float | None = None
    peak_tflops: float | None = None
    pipeline_schedule: str | None = None
    microbatches: int | None = None
    source_config: str | None = None
    maxtext_config: str | None = None
    xla_flags: Mapping[str, str] = dataclasses.field(default_factory=dict)
    unstated: tuple[str, ...] = ()
    notes: str = ""

    def __post_init__(self):
        mesh = {axis: 1 for axis in MESH_AXES}
        unknown = set(self.mesh) - set(MESH_AXES)
        if unknown:
            raise ValueError(f"{self.name}: mesh axes {sorted(unknown)}; expected {MESH_AXES}")
        mesh.update(self.mesh)
        for field, value in (("model", self.model), ("mesh", mesh), ("xla_flags", self.xla_flags)):
            object.__setattr__(self, field, types.MappingProxyType(dict(value)))

    def libtpu_init_args(self) -> str:
        """All of ``xla_flags`` as one ``LIBTPU_INIT_ARGS`` string, groups in order."""
        return " ".join(self.xla_flags.values())


def _llama(layers, width, hidden, heads, kv_heads, head_dim, vocab, activation="swiglu"):
    return dict(
        layers=layers,
        width=width,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
        activation=activation,
    )


# MaxText's 2023 base.yml (MaxText/configs/base.yml at ebb226da8 and 76bd53b0f): one relu
# MLP matrix pair, vocab 32768, logits through the embedding, MHA.
_MAXTEXT_2023_MODEL = " ".join(
    [
        "mlp_activations=[relu]",
        "logits_via_embedding=true",
        "vocab_size=32768",
        "global_parameter_scale=1",
    ]
)


# What Megatron-LM's README table leaves out (see the 70B row's notes).
_MEGATRON_UNSTATED = (
    "model.hidden",
    "model.kv_heads",
    "model.activation",
    "slices",
    "remat",
    "attention",
    "precision",
    "optimizer",
    "peak_tflops",
    "pipeline_schedule",
    "microbatches",
)


RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        name="maxtext-llama2-70b-v5p-512",
        framework="maxtext",
        model=_llama(80, 8192, 28672, 64, 8, 128, 32000),
        seq=4096,
        chip="v5p",
        chips=512,
        topology="v5p:8x8x8",
        mesh=dict(fsdp=512),
        slices=1,
        per_device_batch=4,
        global_batch=2048,
        remat="save_dot_except_mlpwi",
        attention="flash",
        precision="bf16",
        optimizer="adamw",
        mfu=0.654,
        tokens_per_second_per_chip=692,
        peak_tflops=459,
        flops_convention=MAXTEXT_2025,
        source_config=(
            "model_type=llama2-70b ici_fsdp_parallelism=-1 per_device_batch_size=4 "
            "remat_policy=save_dot_except_mlpwi max_target_length=4096 use_iota_embed=True"
        ),
        maxtext_config=(
            "model_name=llama2-70b per_device_batch_size=4 ici_fsdp_parallelism=-1 "
            "remat_policy=save_dot_except_mlpwi max_target_length=4096 use_iota_embed=true"
        ),
        xla_flags=dict(
            DATA_PARALLEL_OVERLAP=DATA_PARALLEL_OVERLAP, CF_FOR_ALL_GATHER=CF_FOR_ALL_GATHER
        ),
        source=(
            f"{MAXTEXT} docs/reference/tiering.md:34 at f588ed5788ae62c78e67e4588b663bd2adc509e5 "
            "(2025-10-29, first publication; v5p Gold: 512 Chips, BF16, SL=4096, MFU 65.4%, "
            "approx 692 tokens/s/device), linking benchmarks/maxtext_v5p_model_configs.py:156-178 "
            "at 92e59fdf547421f647590087f50fea5729da42d8 (llama2_70b_v5p_128)"
        ),
        unstated=("slices", "attention", "optimizer", "peak_tflops"),
        notes=(
            "Chips: the table says 512 chips (v5p-1024); the config is named llama2_70b_v5p_128 "
            "(v5p-128 = 64 chips) but sets ici_fsdp_parallelism=-1, so it is chip-count "
            "agnostic. Batch: per_device_batch_size=4 at the linked commit and at the "
            "publication; 8c9fede59 (2026-01-15) lowered it to 2 'to enable llama2-70b to run on "
            "v5p-128' (so, by that message, 4 did not fit 64 chips). slices=1 assumed: no dcn_* "
            "keys. attention: "
            "not set, base.yml's 'autoselected' takes flash for training with length >= 128 "
            "(src/MaxText/layers/attention_op.py:711-727 at 92e59fdf); optimizer: base.yml "
            "opt_type adamw. Which FLOP count the 65.4% used is not stated: MAXTEXT_2025's "
            "formula gives 4.284e11 FLOP/token (MFU 0.6458 at 692 tokens/s), the pre-#1988 "
            "full-attention count 4.445e11 (0.6701); tiering.md's footnote [2] says some older "
            "results predate #1988."
        ),
    ),
    PublishedRun(
        name="maxtext-llama3.1-70b-v6e-256",
        framework="maxtext",
        model=_llama(80, 8192, 28672, 64, 8, 128, 128256),
        seq=8192,
        chip="v6e",
        chips=256,
        topology="v6e:16x16",
        mesh=dict(fsdp=256),
        slices=1,
        per_device_batch=5,
        global_batch=1280,
        remat="custom",
        attention="flash",
        precision="bf16",
        optimizer="adamw",
        mfu=0.5033,
        tokens_per_second_per_chip=960,
        peak_tflops=918,
        flops_convention=(
            "Pre-#1988 MaxText count: MAXTEXT_2025's formula with attention in full (no "
            "causal half). " + MAXTEXT_2025
        ),
        source_config=(
            "model_type=llama3.1-70b per_device_batch_size=5 ici_fsdp_parallelism=-1 "
            "remat_policy=custom decoder_layer_input=offload query_proj=offload "
            "key_proj=offload value_proj=offload max_target_length=8192 attention=flash "
            "use_iota_embed=True sa_block_q=2048 sa_block_kv=2048 sa_block_kv_compute=2048 "
            "sa_block_q_dkv=2048 sa_block_kv_dkv=2048 sa_block_kv_dkv_compute=2048 "
            "sa_block_q_dq=2048 sa_block_kv_dq=2048 sa_use_fused_bwd_kernel=True"
        ),
        maxtext_config=(
            "model_name=llama3.1-70b per_device_batch_size=5 ici_fsdp_parallelism=-1 "
            "remat_policy=custom decoder_layer_input=offload query_proj=offload "
            "key_proj=offload value_proj=offload max_target_length=8192 attention=flash "
            "use_iota_embed=true sa_block_q=2048 sa_block_kv=2048 sa_block_kv_compute=2048 "
            "sa_block_q_dkv=2048 sa_block_kv_dkv=2048 sa_block_kv_dkv_compute=2048 "
            "sa_block_q_dq=2048 sa_block_kv_dq=2048 sa_use_fused_bwd_kernel=true"
        ),
        xla_flags=dict(
            DENSE_VMEM_LIMIT_FLAG=DENSE_VMEM_LIMIT_FLAG,
            LAYOUT_FOR_ALL_REDUCE_SCATTER=LAYOUT_FOR_ALL_REDUCE_SCATTER,
            DATA_PARALLEL_OVERLAP=DATA_PARALLEL_OVERLAP,
            CF_FOR_ALL_GATHER=CF_FOR_ALL_GATHER,
            HOST_OFFLOAD_FLAGS=HOST_OFFLOAD_FLAGS,
        ),
        source=(
            f"{MAXTEXT} docs/reference/tiering.md:18 at f588ed5788ae62c78e67e4588b663bd2adc509e5 "
            "(Trillium Gold: 256 Chips, BF16, SL=8192, MFU 50.33%, approx 960 tokens/s/device), "
            "linking benchmarks/maxtext_trillium_model_configs.py:959-999 at "
            "92e59fdf547421f647590087f50fea5729da42d8 (llama3_1_70b_8192)"
        ),
        unstated=("slices", "optimizer", "flops_convention", "peak_tflops"),
        notes=(
            "flops_convention inferred by arithmetic: with attention in full the model is "
            "4.814e11 FLOP/token and 960 tokens/s gives MFU 0.5035 (published 0.5033); with "
            "the causal half (4.492e11) it gives 0.4698. v6e-256 is one slice. optimizer: "
            "base.yml opt_type adamw."
        ),
    ),
    PublishedRun(
        name="maxtext-32b-v5p-64",
        framework="maxtext",
        model=_llama(32, 10240, 32768, 32, 32, 256, 32768, activation="relu"),
        seq=2048,
        chip="v5p",
        chips=64,
        topology="v5p:4x4x4",
        mesh=dict(fsdp=16, tensor=4),
        slices=1,
        per_device_batch=8,
        global_batch=512,
        remat="minimal",
        attention="flash",
        precision="bf16",
        optimizer="adamw",
        mfu=0.7147,
        tflops_per_chip=328,
        peak_tflops=459,
        flops_convention=MAXTEXT_2023_DEC,
        source_config=(
            "per_device_batch_size=8 remat_policy=minimal global_parameter_scale=32 "
            "ici_fsdp_parallelism=-1 ici_tensor_parallelism=4 max_target_length=2048 "
            "use_iota_embed=true attention='flash' int8_training=false"
        ),
        maxtext_config=(
            "per_device_batch_size=8 remat_policy=minimal ici_fsdp_parallelism=-1 "
            "ici_tensor_parallelism=4 max_target_length=2048 use_iota_embed=true "
            "attention=flash base_emb_dim=10240 base_num_query_heads=32 base_num_kv_heads=32 "
            "base_mlp_dim=32768 base_num_decoder_layers=32 head_dim=256 " + _MAXTEXT_2023_MODEL
        ),
        xla_flags=dict(LIBTPU_INIT_ARGS=V5P_2023_LIBTPU_INIT_ARGS),
        source=(
            f"{MAXTEXT} MaxText/configs/v5p/README.md:23 at "
            "76bd53b0f44caf989c88189afadeb1062f9254f0 (2023-12-15, first publication; 32B, "
            "1x v5p-128: 328 TFLOP/s/chip, MFU 71.47%), config MaxText/configs/v5p/32b.sh:30-36 "
            "at the same commit"
        ),
        unstated=("optimizer", "peak_tflops"),
        notes=(
            "Shapes: global_parameter_scale=32 on that commit's base.yml (base_emb_dim 2560, "
            "base_num_heads 8, base_mlp_dim 8192, base_num_decoder_layers 16, head_dim 256, "
            "relu, vocab 32768) with pyconfig.get_individual_scales: x4 emb, heads, mlp; x2 "
            "layers. The 2023 decoder predates decoder_block; maxtext_config spells out the "
            "shapes since today's base.yml differs, and drops int8_training (no longer a key). "
            "The script's batch later changed (7 at e301755d4, 6 by 04262f3cf) while the "
            "table stayed. optimizer: base.yml's AdamW keys."
        ),
    ),
    PublishedRun(
        name="maxtext-64b-v5p-64",
        framework="maxtext",
        model=_llama(64, 10240, 32768, 32, 32, 256, 32768, activation="relu"),
        seq=2048,
        chip="v5p",
        chips=64,
        topology="v5p:4x4x4",
        mesh=dict(fsdp=16, tensor=4),
        slices=1,
        per_device_batch=4,
        global_batch=256,
        remat="minimal",
        attention="flash",
        precision="bf16",
        optimizer="adamw",
        mfu=0.7031,
        tflops_per_chip=323,
        peak_tflops=459,
        flops_convention=MAXTEXT_2023_DEC,
        source_config=(
            "per_device_batch_size=4 remat_policy=minimal global_parameter_scale=64 "
            "ici_fsdp_parallelism=-1 ici_tensor_parallelism=4 max_target_length=2048 "
            "use_iota_embed=true attention='flash' int8_training=false"
        ),
        maxtext_config=(
            "per_device_batch_size=4 remat_policy=minimal ici_fsdp_parallelism=-1 "
            "ici_tensor_parallelism=4 max_target_length=2048 use_iota_embed=true "
            "attention=flash base_emb_dim=10240 base_num_query_heads=32 base_num_kv_heads=32 "
            "base_mlp_dim=32768 base_num_decoder_layers=64 head_dim=256 " + _MAXTEXT_2023_MODEL
        ),
        xla_flags=dict(LIBTPU_INIT_ARGS=V5P_2023_LIBTPU_INIT_ARGS),
        source=(
            f"{MAXTEXT} MaxText/configs/v5p/README.md:29 at "
            "76bd53b0f44caf989c88189afadeb1062f9254f0 (64B, 1x v5p-128: 323 TFLOP/s/chip, "
            "MFU 70.31%), config MaxText/configs/v5p/64b.sh:30-36 at the same commit"
        ),
        unstated=("optimizer", "peak_tflops"),
        notes=(
            "Shapes: global_parameter_scale=64 on that commit's base.yml: x4 emb, heads, mlp "
            "and layers. See maxtext-32b-v5p-64 for the 2023 base.yml; the script's batch later "
            "became 3 (04262f3cf) while the table stayed."
        ),
    ),
    PublishedRun(
        name="maxtext-32b-v5e-256",
        framework="maxtext",
        model=_llama(40, 8192, 32768, 32, 32, 256, 32768, activation="relu"),
        seq=2048,
        chip="v5e",
        chips=256,
        topology="v5e:16x16",
        mesh=dict(fsdp=256),
        slices=1,
        per_device_batch=4,
        global_batch=1024,
        remat="full",
        attention="dot_product",
        precision="bf16",
        optimizer="adamw",
        mfu=0.6686,
        tflops_per_chip=132,
        peak_tflops=197,
        flops_convention=MAXTEXT_2023_OCT,
        source_config=(
            "per_device_batch_size=4 remat_policy=full base_emb_dim=8192 base_mlp_dim=32768 "
            "base_num_heads=32 base_num_decoder_layers=40 head_dim=256 max_target_length=2048"
        ),
        maxtext_config=(
            "per_device_batch_size=4 remat_policy=full ici_fsdp_parallelism=-1 "
            "max_target_length=2048 attention=dot_product base_emb_dim=8192 "
            "base_num_query_heads=32 base_num_kv_heads=32 base_mlp_dim=32768 "
            "base_num_decoder_layers=40 head_dim=256 " + _MAXTEXT_2023_MODEL
        ),
        xla_flags=dict(LIBTPU_INIT_ARGS=V5E_2023_LIBTPU_INIT_ARGS),
        source=(
            f"{MAXTEXT} README.md:248 at ebb226da831210cf6d6ff774aef937689bb1d612 (2023-10-24, "
            "first publication; 32B, 1x v5e-256: 132 TFLOP/s/chip, MFU 66.86%), config "
            "MaxText/configs/32b.sh:10 -> end_to_end/test_tflops_32b_params.sh:18-22 at the "
            "same commit"
        ),
        unstated=("optimizer", "peak_tflops"),
        notes=(
            "attention: the script sets none and base.yml then had enable_flash_attention: "
            "False (plain dot-product attention, MaxText/layers.py:330-334). ici_fsdp -1 is "
            "base.yml's default. peak 197: MaxText's v5e peak; 132/0.6686 = 197.4. The same "
            "table moved to MaxText/configs/v5e/README.md at 76bd53b0f next to a new 32b.sh "
            "with global_parameter_scale=32 (emb 10240, 32 layers) and attention='flash': not "
            "the run measured here."
        ),
    ),
    PublishedRun(
        name="megatron-70b-h100-768-pp2",
        framework="megatron-lm",
        model=dict(
            layers=84,
            width=8192,
            hidden=32768,
            heads=64,
            kv_heads=64,
            head_dim=128,
            vocab=131072,
            activation="gelu",
        ),
        seq=4096,
        chip="h100",
        chips=768,
        topology=None,
        mesh=dict(data=48, tensor=8, pipe=2),
        slices=None,
        per_device_batch=0.5,
        global_batch=384,
        remat=None,
        attention=None,
        precision=None,
        optimizer=None,
        mfu=0.42,
        tflops_per_chip=419.7,
        flops_convention=MEGATRON_2024,
        source=(
            f"{MEGATRON} images/model_table.png (row 70B) in README.md:66-68 at "
            "f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4 (2024-07-15, 'New scaling figures on H100 "
            "GPUs'): heads 64, hidden 8192, layers 84, TP 8, PP 2, DP 48, 768 GPUs, batch 384, "
            "419.7 TFLOP/s per GPU, MFU 42%; vocab 131072 and sequence 4096 in the README text"
        ),
        unstated=_MEGATRON_UNSTATED,
        notes=(
            "Not stated: MLP size, activation, precision, attention kernel, recompute, "
            "micro-batch size, pipeline schedule, peak. MLP 4*hidden (Megatron's default "
            "--ffn-hidden-size) and untied embeddings match the table's sizes: 12*L*h^2 + "
            "2*V*h = 69.8B here, 1.74B for the 1.7B row, 7.11B for the 7.1B row. The README "
            "names the overlaps used: --overlap-grad-reduce --overlap-param-gather "
            "--tp-comm-overlap, PP overlap on by default. Per-GPU TFLOP/s / MFU across the "
            "table gives 978-999 (MFU rounded to whole percent), about H100 SXM dense BF16 "
            "(989, MaxText's a3mega peak)."
        ),
    ),
    PublishedRun(
        name="megatron-119b-h100-1536-pp4",
        framework="megatron-lm",
        model=dict(
            layers=92,
            width=10240,
            hidden=40960,
            heads=80,
            kv_heads=80,
            head_dim=128,
            vocab=131072,
            activation="gelu",
        ),
        seq=4096,
        chip="h100",
        chips=1536,
        topology=None,
        mesh=dict(data=48, tensor=8, pipe=4),
        slices=None,
        per_device_batch=0.5,
        global_batch=768,
        remat=None,
        attention=None,
        precision=None,
        optimizer=None,
        mfu=0.43,
        tflops_per_chip=420.5,
        flops_convention=MEGATRON_2024,
        source=(
            f"{MEGATRON} images/model_table.png (row 119B) in README.md:66-68 at "
            "f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4: heads 80, hidden 10240, layers 92, TP 8, "
            "PP 4, DP 48, 1536 GPUs, batch 768, 420.5 TFLOP/s per GPU, MFU 43%"
        ),
        unstated=_MEGATRON_UNSTATED,
        notes="As megatron-70b-h100-768-pp2; 12*L*h^2 + 2*V*h = 118.4B.",
    ),
    PublishedRun(
        name="torchtitan-llama3.1-405b-h100-512-1f1b",
        framework="torchtitan",
        model=_llama(126, 16384, 53248, 128, 8, 128, 128256),
        seq=8192,
        chip="h100",
        chips=512,
        topology=None,
        mesh=dict(fsdp=8, tensor=8, pipe=8),
        slices=64,
        per_device_batch=0.5,
        global_batch=256,
        remat="full",
        attention="sdpa",
        precision="fp8",
        optimizer="AdamW",
        tokens_per_second_per_chip=100,
        flops_convention=TORCHTITAN_2024,
        pipeline_schedule="1F1B",
        microbatches=8,
        source=(
            f"{TORCHTITAN} benchmarks/llama3_h100_202412_torchtitan.md:55-59 at "
            "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a (Table 5, first published in "
            "docs/performance.md at d4c86e3758a84cf23e2e879ab3c995cba9d5e410, 2025-01-30): "
            "3D FSDP 8, TP 8, PP 8, torch.compile, Float8, AsyncTP, 512 GPUs, local batch 32, "
            "global batch 256, full activation checkpointing, 1F1B 100 TPS/GPU, 82.5 GiB; run "
            "at torchtitan "
            "9dec370ad26b5f8e9a7333a0e36165018262644b"
        ),
        unstated=("seq", "microbatches", "model.vocab", "optimizer", "peak_tflops"),
        notes=(
            "Hardware: Grand Teton hosts of 8 H100 with 96 GB HBM2e, 500 W power limit (not the "
            "700 W SXM part). Not stated: sequence length (train_configs/llama3_405b.toml at "
            "9dec370 sets seq_len = 8192, optimizer AdamW) and micro-batches (default: the "
            "number of pipeline stages, config_manager.py:341-352 at 9dec370). Shapes from "
            "torchtitan/models/llama/__init__.py:33-41 (405B) and model.py:238-246 (hidden "
            "53248); vocab 128256 = the Llama 3 tokenizer's 128000 + 256 reserved. Float8 on "
            "nn.Linear with FSDP Float8 all-gather (the toml's [float8]); attention: "
            "F.scaled_dot_product_attention(is_causal=True), model.py:209."
        ),
    ),
    PublishedRun(
        name="torchtitan-llama3.1-405b-h100-512-interleaved",
        framework="torchtitan",
        model=_llama(126, 16384, 53248, 128, 8, 128, 128256),
        seq=8192,
        chip="h100",
        chips=512,
        topology=None,
        mesh=dict(fsdp=8, tensor=8, pipe=8),
        slices=64,
        per_device_batch=0.5,
        global_batch=256,
        remat="full",
        attention="sdpa",
        precision="fp8",
        optimizer="AdamW",
        tokens_per_second_per_chip=128,
        flops_convention=TORCHTITAN_2024,
        pipeline_schedule="Interleaved1F1B",
        source=(
            f"{TORCHTITAN} benchmarks/llama3_h100_202412_torchtitan.md:55-60 at "
            "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a (Table 5): as the 1F1B row, Interleaved "
            "1F1B 128 TPS/GPU, 72.7 GiB"
        ),
        unstated=("seq", "microbatches", "model.vocab", "optimizer", "peak_tflops"),
        notes=(
            "As torchtitan-llama3.1-405b-h100-512-1f1b; micro-batches and stages per rank are "
            "not stated."
        ),
    ),
    PublishedRun(
        name="torchtitan-llama3.1-405b-h100-512-1f1b-seq32k",
        framework="torchtitan",
        model=_llama(126, 16384, 53248, 128, 8, 128, 128256),
        seq=32768,
        chip="h100",
        chips=512,
        topology=None,
        mesh=dict(fsdp=8, tensor=8, pipe=8, context=1),
        slices=64,
        per_device_batch=0.125,
        global_batch=64,
        remat="full",
        attention="sdpa",
        precision="fp8",
        optimizer="AdamW",
        tokens_per_second_per_chip=76,
        flops_convention=TORCHTITAN_2024,
        pipeline_schedule="1F1B",
        microbatches=8,
        source=(
            f"{TORCHTITAN} benchmarks/llama3_h100_202412_torchtitan.md:62-66 at "
            "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a (Table 6, row FSDP 8, CP 1): 4D "
            "parallelism, torch.compile, Float8, AsyncTP, 1F1B, 512 GPUs, TP 8, PP 8, local "
            "batch 8, full activation checkpointing, sequence 32768, 76 TPS/GPU, 75.3 GiB"
        ),
        unstated=("microbatches", "model.vocab", "optimizer", "peak_tflops"),
        notes=("As torchtitan-llama3.1-405b-h100-512-1f1b; global batch = local batch 8 x FSDP 8."),
    ),
)


def by_name(name: str) -> PublishedRun:
    """The row called ``name``; a KeyError lists the names."""
    for run in RUNS:
        if run.name == name:
            return run
    raise KeyError(f"no published run {name!r}; the rows are {[r.name for r in RUNS]}")
