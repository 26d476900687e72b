"""The lm-evaluation-harness model type ``kvsieve``: every request type evaluated under real eviction.

    kvsieve lm-eval --model kvsieve --model_args pretrained=smollm2-135m,policy=trimkv+global,rate=0.75 \\
        --tasks my_task --include_path tasks/

- `loglikelihood` (multiple choice and most tasks): one compression per distinct context, its
  continuations scored as rows of one cache (`scoring.continuation_logprobs`);
- `loglikelihood_rolling` (perplexity tasks): whole documents through a bounded cache, so a size
  (`max_tokens` or `max_bytes`, with `buffer`) is required;
- `generate_until`: the prompt compressed as `kvsieve.generate` does (batches of `batch_size`
  prompts, left-padded), stop strings and `max_gen_toks` honoured.

`policy=full` keeps every entry: the same model type's baseline. The model's tokenizer reaches every
compression, so a policy that asks the model to repeat its context (``kvzip``) runs as in
`kvsieve.compress`. Every argument is checked before the model loads, every request's length before
any request is computed.

Registering ``kvsieve`` imports `lm_eval.models` first: lm-eval 0.4 registers its own model types
only when a name is looked up in an empty registry, so registering ours first would hide them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own table first: `get_model` loads it only into an empty registry)
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from ...runtime.api.compress import refuse_unevictable
from ...runtime.api.config import EvictionConfig
from ...runtime.api.decoding import generate_compressed
from ...runtime.attention.sieve import sieve_attention
from ...selection.checkpoint import load_gates
from ..models import DEFAULT_MODEL, load_model, torch_device, torch_dtype
from ..progress import progress_bar
from .arguments import ModelArgs, with_lm_eval_options
from .scoring import continuation_logprobs, rolling_logprob

#: The name lm-eval knows the model type by.
MODEL_TYPE = "kvsieve"
#: lm-eval's default number of new tokens for `generate_until`.
DEFAULT_MAX_GEN_TOKS = 256


def check_policy_fits(model: torch.nn.Module, config: EvictionConfig) -> None:
    """The errors a first request would meet, now: attention kvsieve cannot serve, nothing to evict, gates
    made for another model."""
    with sieve_attention(model):
        pass
    refuse_unevictable(model, config.limit())
    config.codec(model)  # the storage fits the model's head dimension
    for gates in config.resolved.needs.gates:
        load_gates(gates, model)


@register_model(MODEL_TYPE)
class KVSieveLM(TemplateLM):
    """An lm-eval `LM` running a `transformers` model with a kvsieve policy (see the module docstring).

    Args (lm-eval's `model_args`): `pretrained` (what `kvsieve.load_model` takes), `policy` (a policy
    string, or ``full``), one of `rate` | `max_tokens` | `max_bytes`, `buffer`, `allocator`,
    `question_aware` (the text from the last `question_marker` on is the question), `dtype`, `device`,
    `batch_size` (prompts generated together).
    """

    def __init__(self, pretrained: str = DEFAULT_MODEL, **model_args: Any) -> None:
        super().__init__()
        self.args = ModelArgs.parse(model_args)
        self.config: EvictionConfig | None = self.args.eviction_config()
        self.model, self.tokenizer = load_model(
            pretrained, dtype=torch_dtype(self.args.dtype), device=torch_device(self.args.device)
        )
        if self.config is not None:
            check_policy_fits(self.model, self.config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None):
        """lm-eval's `--device` and `--batch_size` fill in what `model_args` does not say."""
        return cls(**with_lm_eval_options(arg_dict, additional_config))

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # ------------------------------------------------------------------ tokens

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The tokenizer's ids (its own special tokens unless told otherwise: Gemma's BOS, none for SmolLM2)."""
        return self.tokenizer(string, add_special_tokens=add_special_tokens is not False).input_ids

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _check_length(self, tokens: int, what: str) -> None:
        if tokens > self.max_length:
            raise ValueError(
                f"{what} needs {tokens} positions, more than the model's context of {self.max_length} "
                "(max_position_embeddings); shorten the task's inputs"
            )

    def _question_start(self, context: str, tokens: Sequence[int]) -> int | None:
        """Where the question begins in a context's tokens (question-aware runs), else None."""
        if not self.args.question_aware:
            return None
        cut = context.rfind(self.args.question_marker)
        if cut <= 0:
            raise ValueError(
                f"question_aware: the prompt has no question marker {self.args.question_marker!r} after some "
                f"context: ...{context[-80:]!r}; set question_marker= to the text that starts the question"
            )
        return min(len(self.tok_encode(context[:cut])), len(tokens) - 1)

    # ------------------------------------------------------------------ loglikelihood

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """Score the requests, one compression per distinct context (its continuations are rows of one cache)."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for index, (_, context, continuation) in enumerate(requests):
            self._check_length(len(context) + len(continuation), f"loglikelihood request {index}")
            groups.setdefault(tuple(context), []).append(index)
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        with progress_bar("loglikelihood (contexts)", visible=not disable_tqdm) as progress:
            for done, (context, members) in enumerate(groups.items(), start=1):
                text = requests[members[0]][0][0]
                ids = torch.tensor([context], device=self.device)
                continuations = [torch.tensor(requests[i][2]) for i in members]
                question = self._question_start(text, context)
                scored = continuation_logprobs(self.model, self.config, ids, continuations, question, self.tokenizer)
                for index, answer in zip(members, scored, strict=True):
                    results[index] = (answer.logprob, answer.greedy)
                    self.cache_hook.add_partial("loglikelihood", requests[index][0], results[index])
                progress(done, len(groups))
        return results

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Each whole document through a bounded cache, `buffer` tokens per forward (the streaming protocol)."""
        if self.config is not None and not (self.config.sized and self.config.buffer is not None):
            raise ValueError(
                "loglikelihood_rolling (perplexity tasks) feeds whole documents through a bounded cache: "
                "give max_tokens= or max_bytes= (and buffer=) instead of rate="
            )
        documents = [[self.prefix_token_id, *self.tok_encode(r.args[0], add_special_tokens=False)] for r in requests]
        for index, ids in enumerate(documents):
            self._check_length(len(ids), f"rolling request {index}")
        chunk = self.args.buffer if self.config is not None else self.max_length
        results = []
        with progress_bar("loglikelihood_rolling (documents)", visible=not disable_tqdm) as progress:
            for done, (request, ids) in enumerate(zip(requests, documents, strict=True), start=1):
                tokens = torch.tensor([ids], device=self.device)
                results.append(rolling_logprob(self.model, self.config, tokens, chunk, self.tokenizer))
                self.cache_hook.add_partial("loglikelihood_rolling", request.args, results[-1])
                progress(done, len(requests))
        return results

    # ------------------------------------------------------------------ generation

    def _batches(self, requests: list[Instance]) -> Iterator[list[int]]:
        """Request indices with equal gen_kwargs, `batch_size` at a time (one at a time when question-aware)."""
        by_kwargs: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            by_kwargs.setdefault(repr(sorted(request.args[1].items())), []).append(index)
        size = 1 if self.args.question_aware else self.args.batch_size
        for members in by_kwargs.values():
            for start in range(0, len(members), size):
                yield members[start : start + size]

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or as gen_kwargs say) generation from compressed prompts, cut at the first stop string."""
        prompts = [self.tok_encode(r.args[0]) for r in requests]
        for index, (request, prompt) in enumerate(zip(requests, prompts, strict=True)):
            wanted = int(request.args[1].get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            self._check_length(len(prompt) + wanted, f"generate_until request {index} (prompt + max_gen_toks)")
        results = [""] * len(requests)
        done = 0
        with progress_bar("generate_until (prompts)", visible=not disable_tqdm) as progress:
            for members in self._batches(requests):
                texts = self._generate([prompts[i] for i in members], requests[members[0]].args)
                for index, text in zip(members, texts, strict=True):
                    results[index] = text
                    self.cache_hook.add_partial("generate_until", requests[index].args, text)
                done += len(members)
                progress(done, len(requests))
        return results

    def _generate(self, prompts: list[list[int]], args: tuple[str, dict[str, Any]]) -> list[str]:
        """New text for `prompts` (left-padded into one batch), each cut at its first stop string.

        `args`: the first request's (context, gen_kwargs); the context locates the question of a
        question-aware run (one prompt at a time).
        """
        options = dict(args[1])
        until = options.pop("until", None) or []
        until = [until] if isinstance(until, str) else [stop for stop in until if stop]
        options["max_new_tokens"] = int(options.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        options.setdefault("do_sample", False)
        if not options["do_sample"]:
            options.pop("temperature", None)
        options["tokenizer"] = self.tokenizer  # stop strings, and a policy that repeats the prompt (kvzip)
        if until:
            options["stop_strings"] = until
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        with torch.no_grad():
            if self.config is None:
                out = self.model.generate(ids, attention_mask=mask, pad_token_id=pad, **options)
            elif self.args.question_aware:
                start = self._question_start(args[0], prompts[0])
                out = self._compressed(ids[:, :start], question_ids=ids[:, start:], pad_token_id=pad, **options)
            else:
                out = self._compressed(ids, attention_mask=mask, pad_token_id=pad, **options)
        return [self._until_stop(self.tok_decode(row[width:].tolist()), until) for row in out]

    def _compressed(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """`kvsieve.generate`'s path with this model type's policy and budget.

        A policy that scores by the model repeating its prompt (kvzip) cannot re-score while generating:
        the prompt is compressed to a size, and generation grows past it (`kvsieve.generate` without a buffer).
        """
        config = self.config
        repeats = config.resolved.needs.reconstruction is not None
        out, _ = generate_compressed(
            self.model,
            self.model.generate,
            input_ids,
            config.resolved,
            config.limit(),
            None if repeats else config.generation_buffer(),
            codec=config.codec(self.model),
            **kwargs,
        )
        return out

    @staticmethod
    def _until_stop(text: str, until: list[str]) -> str:
        """`text` up to its first stop string (lm-eval's rule)."""
        for stop in until:
            if stop:
                text = text.split(stop)[0]
        return text


__all__ = ["DEFAULT_MAX_GEN_TOKS", "MODEL_TYPE", "KVSieveLM"]
