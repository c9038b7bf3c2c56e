"""Which fields name a run directory (declared per field in difflm/config/), the nested sampler section and
the shared Slurm schema. The compatibility fixture: run directories made before the marks existed keep their
names, so a run trained then is reused, not retrained."""

import copy
import dataclasses

import pytest
import yaml
from helpers import manifest_record
from pydantic import BaseModel

from difflm.config import (
    OPERATIONAL,
    ConfigError,
    FaultsConfig,
    KubernetesLaunchConfig,
    LaunchConfig,
    PipelineConfig,
    SamplerConfig,
    SlurmBase,
    SlurmConfig,
    SlurmLaunchConfig,
    apply_overrides,
    diffusion_model,
    is_flattened,
    is_identity,
    load_config,
    validate,
    with_mode,
)
from difflm.config.train import MOVED
from difflm.models.diffusion.modes import MODES

TRAIN_SECTIONS = ("model", "diffusion", "train", "parallel", "checkpoint")  # difflm.models.launch.torchrun's

# configs/tiny-cpu.yaml and configs/test-tiny.yaml as they were at commit 8347fab (the main of before the marks)
TINY_CPU = {
    "name": "tiny-cpu",
    "workdir": ".difflm",
    "data": {"sources": ["demo:enwiki"], "min_chars": 200, "valid_fraction": 0.05},
    "tokenizer": {"vocab_size": 4096},
    "model": {"preset": "tiny", "swiglu": True, "normalization": "RMSNorm"},
    "diffusion": {"model_running_mode": "difflm-noshift", "antithetic_t": True},
    "train": {
        "seq_length": 128,
        "micro_batch_size": 16,
        "global_batch_size": 16,
        "train_iters": 1200,
        "lr": 0.003,
        "min_lr": 0.0003,
        "warmup_iters": 60,
        "log_interval": 20,
        "eval_interval": 200,
        "eval_iters": 4,
    },
    "checkpoint": {"save_interval": 200},
    "eval": {
        "max_sequences": 64,
        "t_samples": 8,
        "num_samples": 3,
        "sample_length": 48,
        "sampler_steps": 24,
        "temperature": 1.0,
        "task_items": 48,
        "mc_samples": 16,
    },
}
TEST_TINY = {
    "name": "test-tiny",
    "workdir": ".difflm-test",
    "data": {"sources": ["demo:enwiki"], "min_chars": 200, "max_documents": 40, "valid_fraction": 0.1},
    "tokenizer": {"vocab_size": 512},
    "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2},
    "train": {
        "seq_length": 32,
        "micro_batch_size": 4,
        "global_batch_size": 4,
        "train_iters": 20,
        "warmup_iters": 2,
        "log_interval": 5,
        "eval_interval": 10,
        "eval_iters": 2,
    },
    "checkpoint": {"save_interval": 10},
    "eval": {
        "max_sequences": 8,
        "t_samples": 2,
        "num_samples": 1,
        "sample_length": 8,
        "sampler_steps": 4,
        "task_items": 6,
        "mc_samples": 4,
    },
}
# (config, overrides) -> <workdir>/runs/<name>, as computed by `stage_hash` at 8347fab (its deny-list in code)
OLD_RUN_NAMES = [
    ({}, [], "difflm-noshift-bf4c1ca68418-65f598489f8f"),
    (TINY_CPU, [], "difflm-noshift-8d89e3005212-a35d9ca55136"),
    (TEST_TINY, [], "difflm-noshift-ae93725590ed-fec8076e2812"),
    (TEST_TINY, ["diffusion.model_running_mode=ar", "train.train_iters=30"], "ar-ae93725590ed-ba7c344586d7"),
    (
        TEST_TINY,
        ["data.sources=[/data/my.jsonl]", "tokenizer.vocab_size=300", "model.preset=small"],
        "difflm-noshift-caa374701e45-c9b250129646",
    ),
    (
        TEST_TINY,
        [
            "diffusion.model_running_mode=difflm-noshift-uniform",
            "diffusion.time_embedding=true",
            "train.on_nonfinite=stop",
            "train.max_nonfinite_skips=3",
            "train.preempt_signals=[SIGUSR2]",
            "train.peak_tflops=100",
            "train.launcher=slurm",
            "train.slurm.partition=gpu",
            "train.kubernetes.pvc=x",
            "eval.remasking=margin",
            "data.executor=slurm",
            "data.slurm.partition=cpu",
        ],
        "difflm-noshift-uniform-ed07276bb60b-4b0a2608d773",
    ),
    # computed at 2dc7924, before model.swiglu became model.gated_mlp + model.activation (the old name stays accepted)
    (TEST_TINY, ["model.swiglu=false"], "difflm-noshift-ae93725590ed-f3c16ad40340"),
    (TEST_TINY, ["model.gated_mlp=false"], "difflm-noshift-ae93725590ed-f3c16ad40340"),
    (TEST_TINY, ["model.gated_mlp=false", "model.activation=gelu"], "difflm-noshift-ae93725590ed-f3c16ad40340"),
    (TEST_TINY, ["model.swiglu=false", "model.ffn_hidden_size=96"], "difflm-noshift-ae93725590ed-1e595f177bae"),
    (
        TEST_TINY,
        ["model.qkv_bias=true", "model.kv_channels=32", "model.qk_layernorm=true", "diffusion.model_running_mode=ar"],
        "ar-ae93725590ed-7a8c4bfac5b4",
    ),
]


def _run_name(cfg: PipelineConfig) -> str:
    return f"{cfg.diffusion.model_running_mode}-{cfg.stage_hash('data', 'tokenizer')}-{cfg.stage_hash(*TRAIN_SECTIONS)}"


@pytest.mark.parametrize("data, overrides, name", OLD_RUN_NAMES, ids=[n for *_, n in OLD_RUN_NAMES])
def test_run_directories_of_before_the_marks_keep_their_names(data, overrides, name):
    cfg = validate(apply_overrides(copy.deepcopy(data), overrides))
    assert _run_name(cfg) == name


def test_the_run_directory_name_is_what_torchrun_names_it():
    from difflm.models.launch.torchrun import TRAIN_SECTIONS as used
    from difflm.models.launch.torchrun import run_dir

    cfg = validate(copy.deepcopy(TEST_TINY))
    assert used == TRAIN_SECTIONS
    assert run_dir(cfg, manifest_record(cfg.stage_hash("data", "tokenizer"))).name == OLD_RUN_NAMES[2][2]


def _identity_fields(model: type, prefix: str = "") -> set[str]:
    out = set()
    for name, field in model.model_fields.items():
        if not is_identity(field):
            continue
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):  # a nested section
            out |= _identity_fields(sub, prefix if is_flattened(field) else f"{prefix}{name}.")
        else:
            out.add(f"{prefix}{name}")
    return out


# Every field that names a stage's output (data dir: data + tokenizer; run dir: TRAIN_SECTIONS). Adding a field
# to one of these sections forks every existing directory unless the field is marked OPERATIONAL: update this
# list only when the new field does change what the stage computes.
IDENTITY = {
    "data": {
        "kind",  # IF_SET, as the instruction format below: pretraining data (the default) keeps its folders
        "chat_template",
        "messages_key",
        "prompt_key",
        "response_key",
        "system_key",
        "sources",
        "text_key",
        "max_documents",
        "min_chars",
        "max_chars",
        "dedup",
        "strict",
        "unicode_normalization",
        "valid_fraction",
        "test_fraction",
        "split_seed",
        "unique_tokens",  # IF_SET: the budget's subset is a folder of its own; unset, the whole split as before
        "subset_seed",  # IF_SET, and only with unique_tokens (PipelineConfig.identity)
        "tasks",
        "workers",
        "executor",
        "slurm.partition",
        "slurm.time",
        "slurm.sbatch_args",
        "slurm.cpus_per_task",
        "slurm.mem_per_cpu_gb",
    },
    "tokenizer": {"path", "vocab_size", "mask_token", "eos_token", "pad_token"},
    "model": {
        "preset",
        "backend",
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "ffn_hidden_size",
        "gated_mlp",  # named "swiglu" in the hash, its name before
        "activation",  # IF_SET, as the architecture fields below
        "normalization",
        "norm_offset",
        "embedding_scale",
        "rotary_base",
        "qk_layernorm",
        "tie_embeddings",
        "dropout",
        "init_method_std",
        "norm_epsilon",
        "qkv_bias",
        "kv_channels",
        "document_attention",
    },
    "diffusion": {
        "model_running_mode",
        "eps",
        "loss_weighting",
        "uniform_loss",
        "normalize_by",
        "antithetic_t",
        "varilen_prob",
        "time_embedding",
        "time_conditioning",
        "block_size",  # IF_SET: difflm-block's fields name a run only when set
        "clean_attention",
        "ar_loss_weight",
        "block_shift",
        "complementary_masks",
        "cart_p",
        "attention_anneal_steps",
        "mir_mask_share",  # IF_SET: MIR (ar) names a run only when on
        "mir_weight",
        "mir_share_draw",  # IF_SET: fixed (the default) draws as before
        "sft_eos",  # IF_SET: every mode's EOS policy on instruction data names a run only when not the default
    },
    "train": {
        "seq_length",
        "micro_batch_size",
        "global_batch_size",
        "train_iters",
        "epochs",  # IF_SET: replaced by train_iters once the data is prepared, before a run is named
        "lr",
        "min_lr",
        "warmup_iters",
        "lr_schedule",
        "wsd_decay_fraction",
        "wsd_decay_style",
        "weight_decay",
        "decay_embeddings",  # IF_SET: true (the default) decays as before
        "adam_beta1",
        "adam_beta2",
        "clip_grad",
        "seed",
        "log_interval",
        "eval_interval",
        "eval_iters",
        "nproc_per_node",
        "nnodes",
        "init_from",
        "init_from_hf",  # IF_SET: the import replaces it by init_from before a run is named
        "precision",
        "fp8",
        "torch_threads",
    },
    "parallel": {
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "use_distributed_optimizer",
        "sequence_parallel",
    },
    "checkpoint": {"save_interval", "keep_last"},
}
# train's operational fields, the sub-sections that group fields of the flat section of before (FLATTEN) read as
# part of it: train.faults whole, train.launch.launcher / slurm / kubernetes / wait
OPERATIONAL_TRAIN = {"faults", "peak_tflops", "launcher", "slurm", "kubernetes", "wait"}


def _operational_fields(model: type) -> set[str]:
    out = set()
    for name, field in model.model_fields.items():
        if is_flattened(field):
            out |= _operational_fields(field.annotation)
        elif not is_identity(field):
            out.add(name)
    return out


@pytest.mark.parametrize("section", sorted(IDENTITY))
def test_the_identity_fields_are_the_declared_ones(section):
    model = PipelineConfig.model_fields[section].annotation
    found = _identity_fields(model)
    if section == "diffusion":  # one member per mode: the names any of them may hold
        found = set().union(*(_identity_fields(diffusion_model(mode)) for mode in MODES))
    assert found == IDENTITY[section], (
        f"{section}: fields {sorted(found ^ IDENTITY[section])} changed whether they name the {section} stage's "
        f"directory; a field that does not change what the stage computes gets json_schema_extra=OPERATIONAL"
    )


def test_operational_fields_are_marked_where_they_are_declared():
    train = PipelineConfig.model_fields["train"].annotation
    assert _operational_fields(train) == OPERATIONAL_TRAIN
    assert LaunchConfig.model_fields["launcher"].json_schema_extra == OPERATIONAL
    assert all(f.json_schema_extra == OPERATIONAL for f in FaultsConfig.model_fields.values())  # marked where declared
    schema = PipelineConfig.model_json_schema()  # `difflm config schema` shows the marks
    assert schema["$defs"]["LaunchConfig"]["properties"]["launcher"]["identity"] is False


def test_an_operational_field_does_not_fork_the_run_directory():
    base = validate(copy.deepcopy(TEST_TINY))
    for override in (
        "train.faults.on_nonfinite=stop",
        "train.launch.launcher=kubernetes",
        "train.launch.slurm.time=01:00:00",
        "train.launch.kubernetes.namespace=ml",
        "train.launch.wait.poll_seconds=5",
        "train.peak_tflops=989",
        "eval.sampler.steps=99",
        "tracking.enabled=false",
        "workdir=/elsewhere",
    ):
        other = validate(apply_overrides(copy.deepcopy(TEST_TINY), [override]))
        assert other.stage_hash(*TRAIN_SECTIONS) == base.stage_hash(*TRAIN_SECTIONS), override
    assert validate(apply_overrides(copy.deepcopy(TEST_TINY), ["train.optimizer.lr=1e-2"])).stage_hash(
        *TRAIN_SECTIONS
    ) != base.stage_hash(*TRAIN_SECTIONS)


def test_identity_leaves_out_the_operational_fields_only():
    cfg = validate(copy.deepcopy(TEST_TINY))
    ident = cfg.identity("train")
    assert (
        set(ident) == IDENTITY["train"] - {"init_from_hf", "epochs", "decay_embeddings"}
        and ident["lr"] == cfg.train.optimizer.lr
    )  # IF_SET, unset
    spared = validate(apply_overrides(copy.deepcopy(TEST_TINY), ["train.optimizer.decay_embeddings=false"]))
    assert spared.identity("train")["decay_embeddings"] is False
    hf = validate(apply_overrides(copy.deepcopy(TEST_TINY), ["train.init_from_hf=/models/smollm2"]))
    assert hf.identity("train")["init_from_hf"] == "/models/smollm2"
    assert cfg.identity("data")["slurm"] == cfg.data.slurm.model_dump(mode="json")


# ---- the sampler: one nested section, MaskedSampler's own fields --------------------------------------------


def test_the_sampler_section_has_exactly_the_samplers_fields():
    from difflm.models.diffusion import MaskedSampler
    from difflm.models.evaluation.generation import sampler_settings

    assert set(SamplerConfig.model_fields) == {f.name for f in dataclasses.fields(MaskedSampler)}
    cfg = load_config(
        "test-tiny", ["eval.sampler.remasking=margin", "eval.sampler.block_length=4", "eval.sampler.top_p=0.9"]
    )
    built = sampler_settings(cfg.eval)
    assert dataclasses.asdict(built) == cfg.eval.sampler.model_dump()
    assert built.steps == 4 and built.remasking == "margin" and built.block_length == 4
    assert sampler_settings(cfg.eval, steps=7).steps == 7


def test_the_flat_sampler_spelling_of_before_is_read_as_the_nested_one(tmp_path):
    cfg = load_config("test-tiny", ["eval.temperature=0.5", "eval.sampler_steps=9", "eval.threshold=0.8"])
    assert (cfg.eval.sampler.temperature, cfg.eval.sampler.steps, cfg.eval.sampler.threshold) == (0.5, 9, 0.8)
    old = tmp_path / "config.yaml"  # a run's config.yaml written before eval.sampler existed
    old.write_text(yaml.safe_dump(TINY_CPU))
    mine = load_config(str(old), ["eval.sampler.steps=8"])  # a new-spelling override on the old file
    assert mine.eval.sampler.steps == 8 and mine.eval.sampler.temperature == 1.0
    assert "sampler_steps" not in yaml.safe_dump(mine.model_dump(mode="json"))


def test_a_sampler_setting_given_both_ways_names_the_one_spelling():
    assert load_config("tiny-cpu", ["eval.temperature=0"]).eval.sampler.temperature == 0.0  # the override wins
    with pytest.raises(ConfigError, match="eval.sampler_steps is the old spelling of eval.sampler.steps"):
        validate({"eval": {"sampler_steps": 3, "sampler": {"steps": 5}}})  # one file, both spellings
    with pytest.raises(ConfigError, match="unknown field"):
        load_config("test-tiny", ["eval.sampler.sampler_steps=3"])


# ---- one Slurm schema --------------------------------------------------------------------------------------


def test_both_slurm_sections_share_one_schema():
    shared = set(SlurmBase.model_fields)
    assert shared == {"partition", "time", "sbatch_args"}
    assert issubclass(SlurmConfig, SlurmBase) and issubclass(SlurmLaunchConfig, SlurmBase)
    assert shared <= set(SlurmConfig.model_fields) and shared <= set(SlurmLaunchConfig.model_fields)
    cfg = load_config(
        "test-tiny",
        [
            "data.slurm.partition=cpu",
            "data.slurm.sbatch_args={account: a}",
            "train.launch.slurm.partition=gpu",
            "train.launch.slurm.sbatch_args={qos: high}",
        ],
    )
    assert (cfg.data.slurm.partition, cfg.train.launch.slurm.partition) == ("cpu", "gpu")
    assert (cfg.data.slurm.time, cfg.train.launch.slurm.time) == ("04:00:00", "24:00:00")  # each its own default


def test_the_adaln_description_matches_what_the_model_accepts():
    from difflm.config import DiffusionConfig

    text = DiffusionConfig.model_fields["time_conditioning"].description
    assert "model.backend=torch or local" in text


# Each mode with settings away from their defaults -> (stage_hash("diffusion"), stage_hash(*TRAIN_SECTIONS)), as
# computed by the flat `diffusion` section of before the per-mode settings: those runs keep their directories.
MODE_RUN_HASHES = [
    (
        [
            "diffusion.model_running_mode=difflm-noshift",
            "diffusion.eps=0.01",
            "diffusion.loss_weighting=masked_fraction",
            "diffusion.normalize_by=masked_tokens",
            "diffusion.varilen_prob=0.01",
            "diffusion.attention_anneal_steps=50",
        ],
        "78df3df630ba",
        "5654a073b6cf",
    ),
    (
        [
            "diffusion.model_running_mode=difflm-shift",
            "diffusion.loss_weighting=cart",
            "diffusion.cart_p=0.5",
            "diffusion.time_embedding=true",
            "diffusion.time_conditioning=input",
        ],
        "62cc74f7b204",
        "c1958f95138b",
    ),
    (
        [
            "diffusion.model_running_mode=difflm-noshift-uniform",
            "diffusion.uniform_loss=x0_ce",
            "diffusion.eps=0.002",
            "diffusion.antithetic_t=true",
        ],
        "72a19c1a2526",
        "d3043d79f422",
    ),
    (["diffusion.model_running_mode=ar", "diffusion.varilen_prob=0.5"], "d86590762438", "a9d07e5a1f34"),
    (
        [
            "diffusion.model_running_mode=difflm-block",
            "diffusion.block_size=8",
            "diffusion.clean_attention=token_causal",
            "diffusion.ar_loss_weight=0.5",
            "diffusion.block_shift=true",
            "diffusion.complementary_masks=true",
            "diffusion.loss_weighting=masked_fraction",
        ],
        "29a1238dbc5b",
        "3379c169b113",
    ),
    (["diffusion.model_running_mode=difflm-block"], "21e3b3948352", "4d6b885809ce"),
    (["diffusion.model_running_mode=difflm-block", "diffusion.block_size=16"], "d922668d61fa", "e1bf4c809d06"),
]


@pytest.mark.parametrize("overrides, diffusion_hash, run_hash", MODE_RUN_HASHES, ids=[h for _, h, _ in MODE_RUN_HASHES])
def test_every_mode_keeps_the_run_directories_of_the_flat_diffusion_section(overrides, diffusion_hash, run_hash):
    cfg = validate(apply_overrides(copy.deepcopy(TEST_TINY), overrides))
    assert cfg.stage_hash("diffusion") == diffusion_hash
    assert cfg.stage_hash(*TRAIN_SECTIONS) == run_hash


def test_the_ar_source_run_of_the_block_recipe_drops_the_block_settings():
    """Switching to ar keeps the shared settings and drops the block ones (they named the AR run before the
    per-mode sections: that baseline is retrained once, under this name)."""
    cfg = with_mode(load_config("tiny-cpu-ar-to-block"), "ar", attention_anneal_steps=0)  # difflm.tasks.adapt.ar_config
    assert "clean_attention" not in cfg.diffusion.model_dump() and cfg.diffusion.antithetic_t
    assert (cfg.stage_hash("diffusion"), cfg.stage_hash(*TRAIN_SECTIONS)) == ("f17425ce3744", "a7085e2401d2")


def test_a_run_config_of_the_flat_section_loads():
    """A run's config.yaml of before the per-mode sections holds every setting at its default: those of other
    modes are dropped, and the run keeps its name."""
    flat = {
        "model_running_mode": "ar",
        "block_size": 4,
        "clean_attention": "block_causal",
        "ar_loss_weight": 0.0,
        "block_shift": False,
        "complementary_masks": False,
        "eps": 0.001,
        "loss_weighting": "inverse_t",
        "cart_p": 0.3,
        "attention_anneal_steps": 0,
        "uniform_loss": "elbo",
        "normalize_by": "all_tokens",
        "antithetic_t": False,
        "varilen_prob": 0.0,
        "time_embedding": False,
        "time_conditioning": "adaln",
    }
    cfg = validate({**copy.deepcopy(TEST_TINY), "diffusion": flat})
    assert cfg.diffusion.model_dump() == {
        "model_running_mode": "ar",
        "attention_anneal_steps": 0,
        "antithetic_t": False,
        "varilen_prob": 0.0,
        "time_embedding": False,
        "time_conditioning": "adaln",
        "mir_mask_share": 0.0,  # ar's own settings (MIR), at their defaults: off
        "mir_weight": 1.0,
        "mir_share_draw": "fixed",
        "sft_eos": "turn",  # every mode's (instruction data only), at its default
    }
    assert cfg.stage_hash("diffusion") == validate(
        {**copy.deepcopy(TEST_TINY), "diffusion": {"model_running_mode": "ar"}}
    ).stage_hash("diffusion")
    with pytest.raises(
        ConfigError, match="diffusion.block_size is a setting of difflm-block; model_running_mode is ar"
    ):
        validate({**copy.deepcopy(TEST_TINY), "diffusion": {**flat, "block_size": 8}})


# ---- train's sub-sections: optimizer, schedule, faults, launch (with one job wait) ---------------------------

# (overrides on TEST_TINY, the train hash) computed at ddfe0e1, before the sub-sections, in the flat spelling
FLAT_TRAIN_RUN_HASHES = [
    (["train.lr=0.001"], "bb005f4d3c51"),
    (
        [
            "train.lr=0.001",
            "train.min_lr=0.0001",
            "train.weight_decay=0.1",
            "train.clip_grad=0.5",
            "train.adam_beta2=0.95",
        ],
        "83bdbde6a16a",
    ),
    (["train.lr_schedule=wsd", "train.wsd_decay_fraction=0.3", "train.wsd_decay_style=cosine"], "1883332ed224"),
    (["train.warmup_iters=5", "train.lr_schedule=linear"], "b9f2ecac5155"),
    (["train.on_nonfinite=stop", "train.max_nonfinite_skips=2"], "fec8076e2812"),
    (
        [
            "train.launcher=slurm",
            "train.slurm.poll_seconds=5",
            "train.slurm.wait_hours=2",
            "train.nnodes=2",
            "train.micro_batch_size=2",
        ],
        "0a2dc379e4ae",
    ),
    (["train.launcher=kubernetes", "train.kubernetes.poll_seconds=7", "train.kubernetes.wait_hours=1"], "fec8076e2812"),
]
NEW_SPELLING = {
    "train.slurm.poll_seconds": "train.launch.wait.poll_seconds",
    "train.slurm.wait_hours": "train.launch.wait.wait_hours",
    "train.kubernetes.poll_seconds": "train.launch.wait.poll_seconds",
    "train.kubernetes.wait_hours": "train.launch.wait.wait_hours",
    **{f"train.{k}": f"train.{s}.{k}" for k, s in MOVED.items()},
}


def _new_spelling(override: str) -> str:
    key, _, value = override.partition("=")
    return f"{NEW_SPELLING.get(key, key)}={value}"


@pytest.mark.parametrize("overrides, train_hash", FLAT_TRAIN_RUN_HASHES, ids=[h for _, h in FLAT_TRAIN_RUN_HASHES])
@pytest.mark.parametrize("spelling", ["flat", "nested"])
def test_the_train_sub_sections_keep_the_run_directories_of_the_flat_section(overrides, train_hash, spelling):
    if spelling == "nested":
        overrides = [_new_spelling(o) for o in overrides]
    cfg = validate(apply_overrides(copy.deepcopy(TEST_TINY), overrides))
    assert _run_name(cfg) == f"{cfg.diffusion.model_running_mode}-ae93725590ed-{train_hash}"


# a run's config.yaml train section as ddfe0e1 wrote it (the flat section, a wait setting in each cluster section)
FLAT_TRAIN_DUMP = {
    "seq_length": 32, "micro_batch_size": 4, "global_batch_size": 4, "train_iters": 20, "lr": 0.001,
    "min_lr": 0.0003, "warmup_iters": 2, "lr_schedule": "cosine", "wsd_decay_fraction": 0.2,
    "wsd_decay_style": "linear", "on_nonfinite": "skip", "max_nonfinite_skips": 10,
    "preempt_signals": ["SIGTERM", "SIGUSR1"], "weight_decay": 0.01, "adam_beta1": 0.9, "adam_beta2": 0.98,
    "clip_grad": 1.0, "seed": 1234, "log_interval": 5, "eval_interval": 10, "eval_iters": 2, "nproc_per_node": 1,
    "nnodes": 1, "init_from": None, "init_from_hf": None, "precision": "fp32", "fp8": None, "torch_threads": None,
    "peak_tflops": None, "launcher": "kubernetes",
    "slurm": {"partition": None, "time": "24:00:00", "sbatch_args": {}, "signal_seconds": 120, "gpus_per_node": None,
              "python": None, "poll_seconds": 5.0, "wait_hours": None},
    "kubernetes": {"image": "difflm-pipeline:latest", "pvc": "difflm-data", "mount": "/data", "namespace": None,
                   "gpus_per_pod": None, "poll_seconds": 7.0, "start_timeout_minutes": 60.0, "wait_hours": None},
}  # fmt: skip


def test_a_run_config_of_the_flat_train_section_loads(tmp_path):
    old = tmp_path / "config.yaml"
    old.write_text(yaml.safe_dump({**TEST_TINY, "train": FLAT_TRAIN_DUMP}))
    with pytest.warns(DeprecationWarning, match=r"train\.lr is deprecated: use train\.optimizer\.lr"):
        cfg = load_config(str(old))
    t = cfg.train
    assert (t.optimizer.lr, t.schedule.min_lr, t.schedule.warmup_iters, t.faults.on_nonfinite) == (
        0.001,
        3e-4,
        2,
        "skip",
    )
    assert (t.launch.launcher, t.launch.kubernetes.pvc) == ("kubernetes", "difflm-data")
    assert t.launch.wait.poll_seconds == 7.0  # the copy of the launcher in use
    assert _run_name(cfg).endswith("bb005f4d3c51")  # train.lr=0.001's run of before
    again = tmp_path / "again.yaml"  # written back in the new spelling, it reads the same
    again.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert load_config(str(again)) == cfg


def test_an_old_train_key_warns_naming_the_new_one():
    with pytest.warns(DeprecationWarning, match=r"train\.launcher is deprecated: use train\.launch\.launcher"):
        cfg = load_config("test-tiny", ["train.launcher=slurm"])
    assert cfg.train.launch.launcher == "slurm"
    with pytest.warns(DeprecationWarning, match=r"train\.slurm\.poll_seconds is deprecated: use train\.launch\.wait"):
        assert load_config("test-tiny", ["train.slurm.poll_seconds=3"]).train.launch.wait.poll_seconds == 3
    with pytest.warns(DeprecationWarning, match=r"use train\.faults\.preempt_signals"):
        assert load_config("test-tiny", ["train.preempt_signals=[SIGINT]"]).train.faults.preempt_signals == ["SIGINT"]


def test_a_train_setting_given_both_ways_names_the_one_spelling():
    assert load_config("tiny-cpu", ["train.lr=1e-3"]).train.optimizer.lr == 1e-3  # an old override on a new preset
    assert load_config("tiny-cpu", ["train.lr=1e-3", "train.optimizer.lr=2e-3"]).train.optimizer.lr == 2e-3  # the last
    with pytest.raises(ConfigError, match="train.lr is the old spelling of train.optimizer.lr"):
        validate({"train": {"lr": 1e-3, "optimizer": {"lr": 2e-3}}})  # one file, both spellings


def test_one_wait_section_for_both_clusters():
    assert "poll_seconds" not in SlurmLaunchConfig.model_fields and "wait_hours" not in SlurmLaunchConfig.model_fields
    assert "poll_seconds" not in KubernetesLaunchConfig.model_fields
    cfg = load_config("test-tiny", ["train.launch.wait.poll_seconds=2", "train.launch.wait.wait_hours=1"])
    assert (cfg.train.launch.wait.poll_seconds, cfg.train.launch.wait.wait_hours) == (2, 1)


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("train.optimizer.lrr=1", "train.optimizer.lr"),
        ("train.schedule.warmup_iter=1", "train.schedule.warmup_iters"),
        ("train.launch.nnode=1", "train.launch.nnodes"),
        ("train.lrr=1", "train.optimizer.lr"),  # a misspelt old key: the new one
    ],
)
def test_a_misspelt_train_key_gets_the_new_name_suggested(override, suggestion):
    with pytest.raises(ConfigError, match=f"did you mean {suggestion}\\?"):
        load_config("test-tiny", [override])


def test_the_form_schema_holds_the_sub_sections():
    train = PipelineConfig.model_json_schema()["$defs"]["TrainConfig"]["properties"]
    assert {"optimizer", "schedule", "faults", "launch"} <= set(train) and "lr" not in train
    assert set(PipelineConfig().flat()) >= {"train.optimizer.lr", "train.launch.wait.poll_seconds"}
