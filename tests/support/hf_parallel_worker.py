"""Under torchrun (gloo, CPU): imported stock checkpoints loaded at TP in {1,2} x PP in {1,2} give transformers'
logits. One launch of 4 ranks covers every layout and case (tests/unit/models/hf/test_hf_import.py writes cases.json):

    python -m torch.distributed.run --nproc_per_node 4 tests/support/hf_parallel_worker.py CASES_JSON OUT_DIR

cases.json: [{name, overrides, vocab_size, ckpt: {tp: path}, probe: file with {ids, logits}}]. For each layout
and case the reporting rank (last stage, TP rank 0, DP rank 0) writes OUT_DIR/<name>-tp<T>-pp<P>.json with
the relative max logit difference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func

from difflm.config import load_config
from difflm.models.diffusion.modes import build_objective
from difflm.models.megatron import compat
from difflm.models.megatron.checkpointing import load_model_weights
from difflm.models.megatron.gpt import build_model

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def logits_at_layout(cfg, model, ids: torch.Tensor) -> torch.Tensor | None:
    """[b, s, v] of `ids` through megatron's forward-only schedule; None off the last pipeline stage."""

    def forward_step(data, model):
        x = next(data)
        pos = torch.arange(x.shape[1]).unsqueeze(0).expand_as(x)
        out = model(x, pos, None)

        def loss(o):  # o [b, s, v/TP]: the whole vocabulary on every TP rank
            full = tensor_parallel.gather_from_tensor_model_parallel_region(o)
            return o.sum() * 0, torch.tensor(1), {"logits": full.detach()}

        return out, loss

    with torch.no_grad():
        got = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([ids]),
            model=[model],
            num_microbatches=1,
            seq_length=ids.shape[1],
            micro_batch_size=ids.shape[0],
            forward_only=True,
        )
    return got[0]["logits"] if parallel_state.is_pipeline_last_stage() else None


def main(cases_file: str, out_dir: str) -> int:
    dist.init_process_group("gloo")
    compat.activate()
    torch.set_num_threads(1)
    cases = json.loads(Path(cases_file).read_text())
    for tp, pp in LAYOUTS:
        parallel_state.initialize_model_parallel(tp, pp)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        for case in cases:
            probe = torch.load(case["probe"])
            layout = [f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}"]
            b = probe["ids"].shape[0]
            batch = [f"train.micro_batch_size={b}", f"train.global_batch_size={b * dist.get_world_size()}"]
            cfg = load_config("test-tiny", [*case["overrides"], *layout, *batch, "train.launch.nproc_per_node=4"])
            model = build_model(
                cfg,
                case["vocab_size"],
                pre_process=parallel_state.is_pipeline_first_stage(),
                post_process=parallel_state.is_pipeline_last_stage(),
                objective=build_objective(cfg.diffusion),
            ).eval()
            load_model_weights(Path(case["ckpt"][str(tp)]), model)
            got = logits_at_layout(cfg, model, probe["ids"])
            reporting = (
                got is not None
                and parallel_state.get_tensor_model_parallel_rank() == 0
                and parallel_state.get_data_parallel_rank() == 0
            )
            if reporting:
                ref, n = probe["logits"], probe["logits"].shape[-1]
                rel = float((got[..., :n] - ref).abs().max() / ref.abs().max())
                (Path(out_dir) / f"{case['name']}-tp{tp}-pp{pp}.json").write_text(json.dumps({"rel": rel}))
        dist.barrier()
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # dist_checkpointing spawns helpers: the guard is required
    sys.exit(main(*sys.argv[1:]))
