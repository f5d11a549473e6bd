"""batchgen as an lm-evaluation-harness backend: ``lm_eval --model batchgen --model_args pretrained=PATH``.

Importing this module registers the model name ``batchgen`` with lm-eval's registry (its own models stay
registered); ``batchgen eval`` and ``batchgen.integrations.lm_eval.simple_evaluate`` import it first. Every
request of a task goes to the engine at once: the engine batches them continuously and its prefix cache
computes a shared context once (a multiple-choice question's context across its choices). The numbers are the
`hf` backend's: the same tokenization (`add_bos_token` as there), the same left truncation, loglikelihoods from
the prompt's own logprobs (nothing sampled), greedy generation cut at the task's stop strings.
"""

from __future__ import annotations

import json
import logging
from dataclasses import fields
from pathlib import Path
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    _add_special_kwargs,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from batchgen.config import ConfigError, EngineConfig

logger = logging.getLogger(__name__)

# lm-eval's own arguments (and HF-backend ones a command line carries over) that mean nothing to batchgen's
# engine: accepted and dropped. batch_size: the engine batches continuously, whatever is asked.
IGNORED = {"batch_size", "max_batch_size", "trust_remote_code", "tokenizer_mode", "tensor_parallel_size",
           "data_parallel_size", "parallelize", "use_fast_tokenizer", "backend", "tokenizer"}
ENGINE_OPTIONS = {f.name for f in fields(EngineConfig)} - {"model"}


class ModelArgsError(ValueError):
    """A bad ``--model_args`` entry; the message names it."""


def engine_options(args: dict[str, Any]) -> dict[str, Any]:
    """`args` (from --model_args and lm-eval's own --device/--batch_size) as `LLM` options."""
    options, unknown = {}, []
    for key, value in args.items():
        if key == "max_length":  # the HF backend's name for the context length
            key = "max_model_len"
        if key in IGNORED or value is None:
            continue
        if key not in ENGINE_OPTIONS:
            unknown.append(key)
            continue
        options[key] = value
    if unknown:
        raise ModelArgsError(f"--model_args: unknown argument {', '.join(map(repr, unknown))} (batchgen takes "
                             f"pretrained, revision, max_gen_toks, add_bos_token, prefix_token_id, lora_local_path "
                             f"and the engine options: {', '.join(sorted(ENGINE_OPTIONS))})")
    device = str(options.pop("device", ""))
    if device == "cpu" or (device.startswith("cuda") and cuda_available()):
        options["device"] = device
    elif device.startswith("cuda"):  # lm-eval's command line asks for cuda unless told otherwise
        logger.warning("lm-eval asked for device %s, but torch sees no CUDA device: running on the CPU", device)
    return options  # else ("auto", "mps", none) the engine picks


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def adapter_rank(path: str) -> int:
    """A PEFT adapter's rank, from its adapter_config.json (16 when it does not say)."""
    try:
        return int(json.loads((Path(path) / "adapter_config.json").read_text()).get("r", 16))
    except (OSError, ValueError) as e:
        raise ModelArgsError(f"--model_args: lora_local_path: no PEFT adapter at {path} ({e})") from None


@register_model("batchgen")
class BatchgenLM(TemplateLM):
    """lm-eval's ``LM`` on ``batchgen.LLM``: loglikelihood, loglikelihood_rolling and generate_until."""

    def __init__(self, pretrained: str, revision: str | None = None, max_gen_toks: int = 256,
                 add_bos_token: bool | None = None, prefix_token_id: int | None = None,
                 lora_local_path: str | None = None, **args: Any):
        super().__init__()
        from batchgen import LLM, LoRARequest

        options = engine_options(args)
        self.lora_request = None
        if lora_local_path is not None:
            options.update(enable_lora=True, max_lora_rank=max(options.get("max_lora_rank", 16),
                                                               adapter_rank(lora_local_path)))
            self.lora_request = LoRARequest("lm-eval", 1, str(lora_local_path))
        try:
            self.llm = LLM(str(pretrained), revision=revision, **options)
        except (ConfigError, OSError) as e:  # a bad option, a model not found: one line, the argument named
            raise ModelArgsError(f"--model_args: {e}") from None
        self.tokenizer = self.llm.get_tokenizer()
        self._max_gen_toks, self._prefix_token_id = int(max_gen_toks), prefix_token_id
        self.add_bos_token = add_bos_token

    # --- what lm-eval asks of a model -----------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self._prefix_token_id is not None:
            return self._prefix_token_id
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self.llm.llm_engine.model_config.max_model_len

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As the hf backend: `add_bos_token` decides special tokens, except where the text starts with BOS."""
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        return self.tokenizer.encode(string, **special)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's logprobs, whether each of its tokens was the argmax) per request; a
        context longer than the model allows loses its first tokens, as in the hf backend."""
        from batchgen.pooling_params import ScoringParams

        contexts, continuations = [], []
        for _, context, continuation in requests:
            keep = self.max_length - len(continuation)  # the continuation's tokens all stay
            contexts.append(context[-keep:] if len(context) > keep else context)
            continuations.append(continuation)
        scores = self.llm.score_completions(contexts, continuations, ScoringParams(logprobs=1),
                                            use_tqdm=not disable_tqdm, lora_request=self.lora_request)
        results = []
        for (cache_key, _, continuation), score in zip(requests, scores, strict=True):
            if score.error:
                raise RuntimeError(f"batchgen could not score a request: {score.error}")
            greedy = all(max(top, key=top.get) == token for token, top in zip(continuation, score.top_logprobs,
                                                                               strict=True))
            results.append((score.logprob, greedy))
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, results[-1])
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's loglikelihood over disjoint windows of the context length, scored all at once."""
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(text)
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length - 1,
                    context_len=1)):  # the hf backend's windows, one token shorter: batchgen feeds the last token too
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm), strict=True):
            totals[i] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's generation (greedy unless the task samples), stopped at its `until` strings."""
        from batchgen import SamplingParams

        eos = self.tokenizer.decode(self.eot_token_id)
        prompts, params, stops = [], [], []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, default_max_gen_toks=self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_tokens = int(kwargs.pop("max_gen_toks"))
            kwargs.pop("do_sample", None)
            tokens = self.tok_encode(context)
            room = self.max_length - max_tokens
            prompts.append(tokens[-room:] if len(tokens) > room > 0 else tokens)
            params.append(SamplingParams(max_tokens=max_tokens, stop=until, skip_special_tokens=False, **kwargs))
            stops.append(until)
        outputs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm, lora_request=self.lora_request)
        texts = []
        for req, out, until in zip(requests, outputs, stops, strict=True):
            texts.append(postprocess_generated_text(out.outputs[0].text, until, None))
            self.cache_hook.add_partial("generate_until", req.args, texts[-1])
        return texts


def simple_evaluate(**kwargs: Any) -> dict:
    """`lm_eval.simple_evaluate` with `model="batchgen"` as the default."""
    from lm_eval import simple_evaluate as evaluate

    kwargs.setdefault("model", "batchgen")
    return evaluate(**kwargs)


def run_cli(args: list[str]) -> int:
    """lm-eval's command line (`lm-eval run ...`) on `args`, with `--model batchgen` unless one is given; its
    exit code. A bad --model_args entry is one line on stderr, exit 1."""
    import sys

    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    if not any(a == "--model" or a.startswith("--model=") for a in args):
        args = ["--model", "batchgen", *args]
    setup_logging()
    saved, sys.argv = sys.argv, ["batchgen eval", *(args if args[:1] in (["run"], ["ls"], ["validate"])
                                                      else ["run", *args])]
    try:
        cli = HarnessCLI()
        cli.execute(cli.parse_args())
    except ModelArgsError as e:
        print(f"batchgen: error: {e}", file=sys.stderr)
        return 1
    except SystemExit as e:  # argparse's own errors and --help
        return e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = saved
    return 0
