"""lm-evaluation-harness model type `difflm`: any export (masked, uniform or ar) behind lm-eval's three
request kinds, through the same `Scorer` that `difflm eval` uses.

    python -m difflm.models.evaluation.lm_eval_adapter --model difflm \\
        --model_args pretrained=<export folder | run dir | models:/name/version>,mc_samples=32 \\
        --tasks lambada_openai --include_path <dir of task YAMLs> --batch_size 8

is lm-eval's own command line (`lm_eval.__main__.cli_evaluate`) with this module imported first, which
registers the model type (lm-eval has no plugin discovery for models). In Python: import this module, then
`lm_eval.simple_evaluate(model="difflm", model_args=..., tasks=...)`.

model_args: pretrained, mc_samples (32), seed (0), device (cuda when available), dtype (float32 | bfloat16 |
float16 | auto: bfloat16 on CUDA, float32 on the CPU, as eval.dtype), max_length, greedy (compute is_greedy,
true) and the sampler of generate_until: steps, block_length, remasking, threshold, eps, temperature, top_k, top_p,
cfg_scale. `trust_remote_code` (what users pass for LLaDA and Dream) is accepted and ignored: this model type
loads the folder's weights into the pipeline's own class and never runs code from the folder.
"""

from __future__ import annotations

import sys
import warnings

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from difflm.models.diffusion import MaskedSampler
from difflm.models.evaluation.scoring import Scorer
from difflm.models.evaluation.sources import resolve_export
from difflm.models.evaluation.stages import load_model, load_tokenizer, resolve_device

SAMPLER_ARGS = ("steps", "block_length", "remasking", "threshold", "eps", "temperature", "top_k", "top_p", "cfg_scale")


@register_model("difflm")
class DiffLMEval(LM):
    def __init__(
        self,
        pretrained: str,
        mc_samples: int = 32,
        batch_size: int | str = 8,
        seed: int = 0,
        device: str | None = None,
        dtype: str = "float32",
        max_length: int | None = None,
        greedy: bool = True,
        tracking_uri: str | None = None,
        trust_remote_code: bool | str | None = None,
        **kwargs,
    ):
        super().__init__()
        if trust_remote_code is not None:
            print(
                "difflm: trust_remote_code is ignored: the difflm model type loads the export's weights into the "
                "pipeline's own model class and never runs code from the folder",
                file=sys.stderr,
            )
        folder = resolve_export(str(pretrained), tracking_uri)
        if not device or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            device = "cuda" if torch.cuda.is_available() else "cpu"  # lm_eval's --device defaults to cuda
        model = load_model(folder, *resolve_device(str(device), dtype, setting="model_args "))
        unknown = set(kwargs) - set(SAMPLER_ARGS) - {"max_batch_size"}
        if unknown:
            raise ValueError(
                f"unknown model_args {sorted(unknown)} for difflm: see `python -m "
                f"difflm.models.evaluation.lm_eval_adapter --help` and this module's docstring"
            )
        self.sampler = {k: kwargs[k] for k in SAMPLER_ARGS if kwargs.get(k) is not None}
        bs = 8 if str(batch_size).startswith("auto") else int(batch_size)
        self.scorer = Scorer(
            model,
            load_tokenizer(folder),
            mc_samples=int(mc_samples),
            batch_size=bs,
            seed=int(seed),
            max_length=max_length,
            greedy=bool(greedy),
        )

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="difflm loglikelihood")
        out = self.scorer.loglikelihood([r.args for r in requests], progress=bar.update)
        bar.close()
        if any(greedy is None for _, greedy in out):  # lm-eval wants a bool; say that it was not measured
            warnings.warn(
                f"a {self.scorer.mode} model has no greedy order: is_greedy is not defined, reported as "
                "False; metrics built on it (e.g. LAMBADA's acc) are not measured for this model",
                stacklevel=2,
            )
            out = [(ll, bool(greedy)) for ll, greedy in out]
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return self.scorer.loglikelihood_rolling([r.args[0] for r in requests])

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests with the same generation settings go together, in batches of batch_size."""
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(repr(sorted(r.args[1].items())), []).append(i)
        out = [""] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="difflm generate_until")
        for idx in groups.values():
            kw = dict(requests[idx[0]].args[1])
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            n = int(kw.get("max_gen_toks", 64))
            settings = {"steps": n, **self.sampler}
            if "temperature" not in self.sampler:
                settings["temperature"] = float(kw.get("temperature", 0.0)) if kw.get("do_sample") else 0.0
            records = self.scorer.generate([requests[i].args[0] for i in idx], n, MaskedSampler(**settings), until)
            for i, rec in zip(idx, records):
                out[i] = rec["completion"]
            bar.update(len(idx))
        bar.close()
        return out


def main() -> None:
    from lm_eval.__main__ import cli_evaluate  # lm-eval's command line, loaded only when run as one

    sys.argv[0] = "lm_eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
